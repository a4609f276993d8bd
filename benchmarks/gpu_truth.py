"""rentplan's sizing against published H100 training runs nobody here made (benchmarks/gpu-truth/h100.csv; its
README gives each column's source and which rows calibrate what).

    .venv-bench/bin/python benchmarks/gpu_truth.py [--rows TAG,TAG] [--truth DIR] [--out figures.json]
    make bench-truth          # builds .venv-bench (torch and torchvision from this machine's disk, timm), runs it

Each row is estimated under fake tensors with the H100's kernels (target sm80+: flash / memory-efficient
attention, CUDA's autocast policy, the caching allocator simulated), through the same worker and ledger a user's
`rentplan estimate` uses, then planned on the catalog's h100_sxm by the planner itself (select), and compared:

  alloc  = the estimate's allocated peak (first update and steady updates) + the BLAS workspaces a CUDA run holds
           (planner/models/overheads.py: cuBLAS and cuBLASLt, for the forward's thread and the backward's) ÷ the
           row's active peak, which counts them
  resv   = the simulated reserved peak (the same phases) + those workspaces' reserved bytes ÷ the row's reserved peak
  need   = the planner's need on h100_sxm (largest phase, + the BLAS workspaces it adds; not the CUDA context,
           which is outside PyTorch's counters) ÷ the row's reserved peak: below 1.00 is a false fit
  time   = the planned update time (fast end – slow end, point) against the row's step_ms

The rows' method (sanketpurandare/mem-run-estimator, driver.py and exp_utils.py): torch.optim.Adam, peaks over 5
iterations after reset_peak_memory_stats; fp16 autocast without a scaler ("fp16" here: rentplan's scaler adds a
found-inf flag and a scale); pure fp16 ("16-true"); inputs random. Three figures are fitted to these rows, and said
so where they are used: the cuDNN workspace allowance, the estimator's own 1 % allowance (planner/models/overheads.py)
and the point time's compute and memory factors (--fit prints the fit and each row's
leave-one-out error: the row predicted by the fit of the other 14).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.records import ProbeConfig  # noqa: E402

TRUTH = ROOT / "benchmarks" / "gpu-truth"
# What these rows calibrate (benchmarks/gpu-truth/README.md): said under every table, so no figure reads as held out
CALIBRATION = ("fitted on these rows: the estimator's +1.0 % allowance (all 15), the +6 % cuDNN workspace "
               "allowance (the 7 convolution rows: vith, convnext2h, clipL336) and the point time's k_compute and "
               "k_memory (all 15): the memory columns are in-sample for those allowances; the point's held-out check "
               "is --fit's leave-one-out (each row predicted by the fit of the other 14)")
WORKLOAD = f"{ROOT / 'benchmarks' / 'truth_workloads.py'}:truth"
PRECISION = {"fp32": "fp32", "fp16 autocast on fp32 weights": "fp16",
             "pure fp16 (weights and Adam state fp16)": "16-true"}
TRAINING = ("first_step", "steady")
ROWS_TRANSFORMERS = "4.46."


def row_workload(row: dict, truth: Path) -> dict:
    kind = row["kind"]
    if kind.startswith("timm"):
        return {"kind": "timm", "source": row["model"].split()[-1]}
    if kind.startswith("hf CLIPModel"):
        return {"kind": "clip", "source": str(truth / row["config"])}
    return {"kind": "seq2seq" if "seq2seq" in kind else "causal-lm", "source": str(truth / row["config"])}


def row_config(row: dict, truth: Path) -> ProbeConfig:
    mb, seq = int(row["micro_batch"]), int(row["seq_len_or_image"])
    return ProbeConfig(workload=WORKLOAD, params_json=json.dumps(row_workload(row, truth), sort_keys=True),
                       micro_batch=mb, seq_len=seq, eval_seq_len=seq, eval_micro_batch=mb,
                       precision=PRECISION[row["precision"]], optimizer="adamw", checkpointing=False, device="cpu",
                       mode="estimated", target="sm80+")


def planned(lines, cfg: ProbeConfig):
    """The planner's own row for one h100_sxm GPU, for a campaign of exactly this shape (one update of mb)."""
    import yaml

    from planner.decisions.select import select
    from planner.inputs.campaign_spec import load_campaign_text
    from planner.inputs.catalog import load_catalog

    catalog = load_catalog()
    spec = {"name": "truth", "workload": cfg.workload, "params": json.loads(cfg.params_json),
            "precision": cfg.precision, "optimizer": cfg.optimizer, "seq_len": cfg.seq_len,
            "effective_batch": cfg.micro_batch, "updates": 10,
            "eval": {"every_updates": 10, "examples": cfg.micro_batch, "seq_len": cfg.seq_len},
            "setup_hours": 0, "variants": [{"id": "control", "lr": 1e-4}]}
    campaign = load_campaign_text(yaml.safe_dump(spec), "truth")
    offer = next(o for o in catalog.offers if o.gpu == "h100_sxm" and o.gpus_per_instance == 1)
    sheet = select(campaign, lines, catalog, 0.10, offers=[offer])
    return sheet.iloc[0], catalog


def compare(row: dict, lines, cfg: ProbeConfig) -> dict:
    ok = lines[lines["verdict"] == "ok"]
    bad = lines[lines["verdict"] != "ok"]
    if not bad.empty:
        return {"tag": row["tag"], "error": "; ".join(f"{r.phase} {r.verdict} {r.detail}" for r in bad.itertuples())}
    train = ok[ok["phase"].isin(TRAINING)]
    active, reserved, step_s = float(row["active_peak_bytes"]), float(row["reserved_peak_bytes"]), \
        float(row["step_ms"]) / 1e3
    from planner.models.overheads import workspace_allocated_bytes, workspace_bytes

    alloc = float(train["peak_allocated_bytes"].max()) + workspace_allocated_bytes("9.0")
    resv = float(train["simulated_reserved_bytes"].max()) + workspace_bytes("9.0")
    plan, catalog = planned(lines, cfg)
    outside = float(plan["context_bytes"]) - catalog.context_bytes  # the BLAS workspaces the planner adds
    need = float(plan["need_bytes"]) + outside
    lo, hi, point = (float(plan[f"update_s_{e}"]) for e in ("low", "high", "point"))
    return {"tag": row["tag"], "alloc": alloc / active, "resv": resv / reserved, "need": need / reserved,
            "need_phase": plan["need_phase"], "micro_batch_planned": int(plan["micro_batch"]),
            "time_ms": f"{lo * 1e3:.0f}–{hi * 1e3:.0f}", "point_ms": point * 1e3, "step_ms": step_s * 1e3,
            "inside": lo <= step_s <= hi, "point_error": point / step_s - 1, "alloc_gib": alloc / 2**30,
            "active_gib": active / 2**30, "need_gib": need / 2**30, "reserved_gib": reserved / 2**30,
            "basis": plan["time_basis"]}


def time_parts(lines, cfg: ProbeConfig) -> dict:
    """The uncalibrated point time of the steady update, split into compute-bound (matmul, attention),
    memory-bound and launch-bound seconds: what --fit scales; and the compute-bound convolutions' seconds at the
    point's own convolution figures (roofline.CONV_MODEL, fitted on the public ConvNet rows of
    benchmarks/conv_truth.py), which --fit leaves as they are, as it does the launches."""
    from planner.inputs.catalog import load_catalog
    from planner.models.roofline import POINT, Fractions, census_for, op_seconds

    gpu = load_catalog().gpu("h100_sxm")
    fr = Fractions("uncalibrated point", None, 0.60, 0.50, 0.85, 7e-6, conv_tf32=POINT.conv_tf32,
                   conv_half=POINT.conv_half, conv_half_nchw=POINT.conv_half_nchw)
    st = lines[lines["phase"] == "steady"].iloc[0]
    c = census_for(st["op_profile_json"], "sm80+", int(st["micro_batch"]), int(st["seq_len"]),
                   int(st["grad_accum"])).for_precision(cfg.precision)
    parts = {"compute": 0.0, "memory": 0.0, "launch": 0.0, "conv": 0.0}
    for row in c.profile["ops"]:
        t, bound = op_seconds(row, gpu, c.tf32, fr, c.conv_tf32, c.conv_layout)
        parts["conv" if row[0] == "conv" and bound == "compute" else bound] += row[4] * t
    parts["launch"] += max(0.0, c.profile["launches"] - sum(r[4] for r in c.profile["ops"])) * fr.launch_s
    return parts


def fit(rows: list[dict]) -> str:
    """real = k_c × compute + k_m × memory + launch + conv, least squares on relative error, and each row predicted by
    the fit of the others (leave-one-out): the figures the point estimate's calibration rests on."""
    import numpy as np

    def solve(rs):
        a = np.array([[r["parts"]["compute"], r["parts"]["memory"]] for r in rs]) / np.array(
            [[r["step_ms"] / 1e3] for r in rs])
        y = np.array([1 - (r["parts"]["launch"] + r["parts"]["conv"]) / (r["step_ms"] / 1e3) for r in rs])
        return np.linalg.lstsq(a, y, rcond=None)[0]

    ok = [r for r in rows if "parts" in r]
    k = solve(ok)
    loo = []
    for i, r in enumerate(ok):
        kc, km = solve(ok[:i] + ok[i + 1:])
        p = r["parts"]
        loo.append((kc * p["compute"] + km * p["memory"] + p["launch"] + p["conv"]) / (r["step_ms"] / 1e3) - 1)
    return (f"fit on {len(ok)} rows: k_compute {k[0]:.3f}, k_memory {k[1]:.3f}; leave-one-out within 15 % on "
            f"{sum(abs(e) <= .15 for e in loo)} (median {statistics.median(abs(e) for e in loo):.1%}): "
            + ", ".join(f"{r['tag']} {e:+.0%}" for r, e in zip(ok, loo)))


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return f"{len(rows)} rows, all failed"
    alloc = [abs(r["alloc"] - 1) for r in ok]
    need = [r["need"] for r in ok]
    points = [abs(r["point_error"]) for r in ok]
    return (f"{len(ok)}/{len(rows)} rows estimated: allocated within 5 % of active on {sum(a <= .05 for a in alloc)} "
            f"(max {max(alloc):.1%}); need 1.00–1.10 × reserved on {sum(1 <= n <= 1.10 for n in need)} (min "
            f"{min(need):.3f}, max {max(need):.3f}; false fits {sum(n < 1 for n in need)}); step time inside the "
            f"range on {sum(r['inside'] for r in ok)}; point within 15 % on {sum(p <= .15 for p in points)} (median "
            f"error {statistics.median(points):.1%})")


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    out = []
    for r in rows:
        if "error" in r:
            out.append([r["tag"], "error: " + r["error"][:80]] + [""] * 7)
            continue
        out.append([r["tag"], f"{r['alloc_gib']:.2f}/{r['active_gib']:.2f} = {r['alloc']:.3f}", f"{r['resv']:.3f}",
                    f"{r['need_gib']:.2f}/{r['reserved_gib']:.2f} = {r['need']:.3f}"
                    + (f" ({(r['reserved_gib'] - r['need_gib']) * 1024:.0f} MiB short)" if r["need"] < 1 else ""),
                    r["need_phase"],
                    r["time_ms"], f"{r['point_ms']:.0f}", f"{r['step_ms']:.0f}",
                    f"{'yes' if r['inside'] else 'no'} ({r['point_error']:+.0%})"])
    return tabulate(out, headers=["row", "alloc GiB est/active", "resv sim/real", "need GiB / reserved", "need phase",
                                  "planned ms", "point", "step ms", "inside (point err)"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--truth", default=str(TRUTH))
    ap.add_argument("--rows", default="", help="comma-separated tags (default: every row)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--fit", action="store_true", help="also fit the point's compute and memory factors (with "
                                                       "leave-one-out errors)")
    args = ap.parse_args()
    truth = Path(args.truth)
    with open(truth / "h100.csv") as f:
        rows = list(csv.DictReader(f))
    if args.rows:
        rows = [r for r in rows if r["tag"] in set(args.rows.split(","))]
    try:
        import timm  # noqa: F401
    except ImportError:
        skipped = [r["tag"] for r in rows if r["kind"].startswith("timm")]
        rows = [r for r in rows if not r["kind"].startswith("timm")]
        if skipped:
            print(f"timm is not installed: {', '.join(skipped)} skipped (make bench-truth builds .venv-bench)",
                  file=sys.stderr)
    try:
        import transformers
    except ImportError:
        transformers = None
        skipped = [r["tag"] for r in rows if not r["kind"].startswith("timm")]
        rows = [r for r in rows if r["kind"].startswith("timm")]
        print(f"transformers is not installed: {', '.join(skipped)} skipped (make bench-truth builds .venv-bench)",
              file=sys.stderr)
    if transformers is not None and not transformers.__version__.startswith(ROWS_TRANSFORMERS):
        print(f"transformers {transformers.__version__}: the rows ran the {ROWS_TRANSFORMERS} line (2024-10), whose "
              f"model code is what they measured; make bench-truth pins it", file=sys.stderr)
    if not rows:
        sys.exit("Error: no row can run here (timm and transformers missing): run make bench-truth")
    from planner.ledger import read_lines
    from probes.runner import run_grid

    results = []
    with tempfile.TemporaryDirectory() as d:
        for row in rows:
            cfg = row_config(row, truth)
            t0 = time.perf_counter()
            run_grid([cfg], f"{d}/{row['tag']}.db", progress=lambda m: None)
            lines = read_lines(f"{d}/{row['tag']}.db")
            results.append(compare(row, lines, cfg))
            if args.fit and "error" not in results[-1]:
                results[-1]["parts"] = time_parts(lines, cfg)
            print(f"{row['tag']}: estimated and planned in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    import torch

    hf = transformers.__version__ if transformers is not None else "not installed"
    print(f"rentplan vs {truth / 'h100.csv'} (estimates: fake tensors, target sm80+, torch {torch.__version__}, "
          f"transformers {hf}; plan: h100_sxm from catalog.yaml)\n")
    print(table(results))
    print("\n" + summary(results))
    print(CALIBRATION)
    if args.fit:
        print("\n" + fit(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
