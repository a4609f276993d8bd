"""rentplan's LoRA and QLoRA sizing against published runs of another code base (benchmarks/published-lora/runs.csv;
its README gives each row's source and role).

    PYTHONPATH=. .venv/bin/python benchmarks/published_lora.py [--rows TAG,TAG] [--out figures.json]

Each row is estimated under fake tensors with its GPU's kernels (A10G and A100: sm80+) at its micro-batch and at
the next one (or the one that ran out of memory), through the same worker and ledger a user's `rentplan estimate`
uses, with the row's loader described as the run had it: Lightning's BitsandbytesPrecision under litgpt (every
nn.Linear quantized, the head included; from float16; nf4 without, nf4-dq with double quantization) and the
bitsandbytes version litgpt pinned (probes/quantize.py says what each version keeps). Then it is planned by the
planner itself (select) on one GPU of the row's kind, and compared:

  alloc   = the estimate's allocated peak (first update, steady updates) + the BLAS workspaces a CUDA run holds,
            against the row's `torch.cuda.max_memory_allocated()` (litgpt prints it in GB of 1e9 bytes: lit-gpt
            finetune/lora.py:156 at 8641822, litgpt finetune/lora.py:234 at eda1aaaf)
  planned = the planner's largest micro-batch on that GPU (max_micro_batch), which must be at least the one that
            ran and below the one that ran out of memory, where the source names one

The estimate models Hugging Face's Llama/Mistral code with peft's LoRA, not litgpt's own model code: the rows are
another code base's, which is the point of holding them out.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.records import ProbeConfig  # noqa: E402

HERE = ROOT / "benchmarks" / "published-lora"
TRAINING = ("first_step", "steady")
GPU = {"a10g": ("aws-a10g-1x", "8.6"), "a100_40gb": ("lambda-a100_40gb-1x", "8.0")}


def row_params(row: dict) -> dict:
    """The workload's parameters: LoRA as the row ran it, and its quantized base as litgpt's loader made it."""
    params = {"lora": row["lora"]}
    if row["quant"]:
        params.update({"quantize": "nf4", "double_quant": row["quant"].endswith("-dq"), "quant_head": True,
                       "quant_from": "float16", "bnb": "0.41.1" if row["gpu"] == "a100_40gb" else "0.42.0"})
    return params


def row_configs(row: dict, legacy: bool = False) -> list[ProbeConfig]:
    """legacy: the estimate before #43 item 2 (quantize=nf4 on this machine's bitsandbytes, transformers' layout)."""
    params = row_params(row)
    if legacy and row["quant"]:
        params = {"lora": row["lora"], "quantize": "nf4"}
    mb, seq = int(row["micro_batch"]), int(row["seq_len"])
    other = int(row["oom_micro_batch"]) if row["oom_micro_batch"] else mb + 1
    return [ProbeConfig(workload=f"hf:{HERE / 'configs' / row['config']}",
                        params_json=json.dumps(params, sort_keys=True),
                        micro_batch=m, seq_len=seq, eval_seq_len=seq, eval_micro_batch=m, precision="bf16-true",
                        optimizer="adamw", device="cpu", mode="estimated", target="sm80+")
            for m in ((mb,) if legacy else (mb, other))]


def planned(lines, cfg: ProbeConfig, gpu: str) -> dict:
    import yaml

    from planner.decisions.select import select
    from planner.inputs.campaign_spec import load_campaign_text
    from planner.inputs.catalog import load_catalog

    catalog = load_catalog()
    spec = {"name": "published", "workload": cfg.workload, "params": json.loads(cfg.params_json),
            "precision": cfg.precision, "optimizer": cfg.optimizer, "seq_len": cfg.seq_len,
            "effective_batch": 16, "updates": 10,
            "eval": {"every_updates": 10, "examples": cfg.micro_batch, "seq_len": cfg.seq_len,
                     "micro_batch": cfg.micro_batch},
            "setup_hours": 0, "variants": [{"id": "control", "lr": 1e-4}]}
    campaign = load_campaign_text(yaml.safe_dump(spec), "published")
    offer = next(o for o in catalog.offers if o.id == GPU[gpu][0])
    return select(campaign, lines, catalog, 0.10, offers=[offer]).iloc[0]


def compare(row: dict, lines, cfg: ProbeConfig) -> dict:
    from planner.models.overheads import workspace_allocated_bytes

    bad = lines[lines["verdict"] != "ok"]
    if not bad.empty:
        return {"tag": row["tag"], "error": "; ".join(f"{r.phase} {r.verdict} {r.detail}" for r in bad.itertuples())}
    mine = lines[(lines["micro_batch"] == cfg.micro_batch) & lines["phase"].isin(TRAINING)]
    alloc = float(mine["peak_allocated_bytes"].max()) + workspace_allocated_bytes(GPU[row["gpu"]][1])
    measured = float(row["measured_gb"]) * 1e9
    plan = planned(lines, cfg, row["gpu"])
    mb_max = plan.get("max_micro_batch")
    mb_max = None if mb_max is None or mb_max != mb_max else int(mb_max)
    oom = int(row["oom_micro_batch"]) if row["oom_micro_batch"] else None
    ok_mb = mb_max is not None and mb_max >= cfg.micro_batch and (oom is None or mb_max < oom)
    steady = lines[(lines["micro_batch"] == cfg.micro_batch) & (lines["phase"] == "steady")]
    return {"tag": row["tag"], "role": row["role"], "gpu": row["gpu"], "alloc_gb": alloc / 1e9,
            "measured_gb": measured / 1e9, "error": alloc / measured - 1, "ran": cfg.micro_batch, "oom": oom,
            "planned_max": mb_max, "planned_ok": ok_mb, "need_gib": float(plan["need_bytes"]) / 2**30,
            "note": steady["detail"].iloc[0] if len(steady) else ""}


def table(results: list[dict], legacy: dict[str, dict] | None = None) -> str:
    head = ["row", "role", "GPU", "measured GB", "estimate GB", "error"] + (["before"] if legacy else []) + \
        ["ran", "OOM at", "planned max", "ok"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        if "alloc_gb" not in r:
            out.append(f"| {r['tag']} | error: {r.get('error')} |")
            continue
        before = []
        if legacy:
            b = legacy.get(r["tag"], {})
            before = [f"{b['error']:+.1%}" if "alloc_gb" in b else "-"]
        out.append("| " + " | ".join([r["tag"], r["role"], r["gpu"], f"{r['measured_gb']:.2f}", f"{r['alloc_gb']:.2f}",
                                      f"{r['error']:+.1%}", *before, str(r["ran"]), str(r["oom"] or "-"),
                                      str(r["planned_max"]), "yes" if r["planned_ok"] else "NO"]) + " |")
    return "\n".join(out)


def run(rows: list[dict], legacy: bool, d: str) -> list[dict]:
    from planner.ledger import read_lines
    from probes.runner import run_grid

    results = []
    for row in rows:
        cfgs = row_configs(row, legacy)
        t0 = time.perf_counter()
        db = f"{d}/{row['tag']}{'-legacy' if legacy else ''}.db"
        run_grid(cfgs, db, progress=lambda m: None)
        results.append(compare(row, read_lines(db), cfgs[0]))
        print(f"{row['tag']}{' (before)' if legacy else ''}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="", help="comma-separated tags (default: every row)")
    ap.add_argument("--before", action="store_true", help="also the QLoRA rows as estimated before #43 item 2 "
                                                          "(this machine's bitsandbytes, transformers' layout)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(HERE / "runs.csv") as f:
        rows = list(csv.DictReader(f))
    if args.rows:
        rows = [r for r in rows if r["tag"] in set(args.rows.split(","))]
    with tempfile.TemporaryDirectory() as d:
        results = run(rows, False, d)
        legacy = {r["tag"]: r for r in run([r for r in rows if r["quant"]], True, d)} if args.before else None
    print(table(results, legacy))
    held = [r for r in results if r.get("role") == "held-out" and "alloc_gb" in r]
    if held:
        worst = max(held, key=lambda r: abs(r["error"]))
        print(f"\nheld out: {len(held)} rows, largest |error| {abs(worst['error']):.1%} ({worst['tag']}); planned "
              f"micro-batch within [ran, OOM): {sum(r['planned_ok'] for r in held)}/{len(held)}")
    for r in results:
        if r.get("note") and "0.43.2" in r["note"]:
            print(f"{r['tag']}: {r['note'].split('; ', 1)[-1]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"after": results, "before": legacy}, indent=2, default=str))


if __name__ == "__main__":
    main()
