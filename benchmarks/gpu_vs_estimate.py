"""Estimate against measurement on the GPU at hand: allocated peak, reserved peak (need), update time.

    python benchmarks/gpu_vs_estimate.py [--device cuda] [--quick] [--out figures.json]

For each configuration (built-in gpt with GPT-2's dropout, the classifier, two Hugging Face configs from
benchmarks/configs; fp32 and bf16; checkpointing off and on; micro-batch 1 to 16) it probes the real thing on
the device and estimates it for the device's kernel target, then prints, per configuration:
  allocated: estimated ÷ measured peak allocated (max over phases), and the worst phase
  need: (simulated reserved + BLAS workspaces) ÷ measured peak reserved (max over phases)
  time: the measured update against the planned range and point (planner/models/roofline.py)
and a summary against the targets (allocated within 5 %; need 1.00–1.10 × reserved, never below; time
inside the range, point within 15 %). With --device cpu (no GPU) it runs the same pipeline against CPU
kernels: it checks the plumbing, not the GPU rules.

It also records the real allocator's history for two configurations (torch.cuda.memory._record_memory_history
from the process start, allocation events without stacks) and replays it through planner/models/allocator.py:
real against simulated reserved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.records import PHASES, ProbeConfig  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
GPT2ISH = {"layers": 6, "d_model": 768, "heads": 12, "vocab": 8192, "dropout": 0.1}
CLASSIFIER = {"layers": 4, "d_model": 512, "heads": 8, "vocab": 8192}
# (workload, params, micro_batch, seq_len, precision, checkpointing)
GRID = [
    ("builtin:gpt", GPT2ISH, 1, 1024, "bf16", False),
    ("builtin:gpt", GPT2ISH, 8, 1024, "bf16", False),
    ("builtin:gpt", GPT2ISH, 8, 1024, "bf16", True),
    ("builtin:gpt", GPT2ISH, 16, 512, "bf16", False),
    ("builtin:gpt", GPT2ISH, 4, 512, "fp32", False),
    ("builtin:gpt", GPT2ISH, 4, 512, "fp32", True),
    ("builtin:classifier", CLASSIFIER, 16, 512, "bf16", False),
    ("builtin:classifier", CLASSIFIER, 8, 512, "fp32", False),
    (f"hf:{CONFIGS / 'gpt2-small'}", {}, 8, 1024, "bf16", False),
    (f"hf:{CONFIGS / 'gpt2-small'}", {}, 8, 1024, "bf16", True),
    (f"hf:{CONFIGS / 'gpt2-small'}", {}, 4, 512, "fp32", False),
    (f"hf:{CONFIGS / 'llama-160m'}", {}, 8, 1024, "bf16", False),
    (f"hf:{CONFIGS / 'llama-160m'}", {}, 8, 1024, "bf16", True),
    (f"hf:{CONFIGS / 'llama-160m'}", {}, 2, 2048, "fp32", False),
]
QUICK = [(w, {**p, "layers": 1, "d_model": 64, "heads": 2, "vocab": 256} if p else p, mb, min(seq, 128), prec, ck)
         for w, p, mb, seq, prec, ck in GRID if w.startswith("builtin")][:4]


def configs(device: str, mode: str, target: str, grid) -> list[ProbeConfig]:
    return [ProbeConfig(workload=w, params_json=json.dumps(p, sort_keys=True), micro_batch=mb, seq_len=seq,
                        eval_seq_len=seq, eval_micro_batch=mb, precision=prec, checkpointing=ck, device=device,
                        mode=mode, target=target if mode == "estimated" else "") for w, p, mb, seq, prec, ck in grid]


def device_facts(device: str):
    import torch

    from planner.inputs.catalog import load_catalog
    from planner.models.kernels import kernel_target
    from planner.models.timing import match_catalog_gpu

    catalog = load_catalog()
    if device == "cpu":
        return catalog, catalog.gpu("h100_sxm"), "cpu", "CPU (plumbing only: GPU rules not exercised)"
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    gpu = match_catalog_gpu(name, catalog)
    return catalog, gpu, kernel_target(f"{major}.{minor}"), name


def compare(measured, estimated, catalog, gpu, device: str) -> list[dict]:

    from planner.decisions.evidence import run_facts
    from planner.models.overheads import workspace_allocated_bytes, workspace_bytes
    from planner.models.timing import throughput, update_time

    class Ev:  # the evidence shape timing.throughput reads: one run's facts
        def __init__(self, facts):
            self.facts = facts

    rows = []
    mf, ef = run_facts(measured), run_facts(estimated)
    shape = ["workload", "params_json", "micro_batch", "seq_len", "precision", "checkpointing"]
    est_ids = {tuple(e[k] for k in shape): e_id for e_id, e in ef.iterrows()}
    for m_id, m in mf.iterrows():
        e_id = est_ids[tuple(m[k] for k in shape)]
        ml, el = (measured[measured.run_id == m_id].set_index("phase"),
                  estimated[estimated.run_id == e_id].set_index("phase"))
        if not (ml["verdict"] == "ok").all() or not (el["verdict"] == "ok").all():
            rows.append({"config": label(m), "error": f"measured {set(ml['verdict'])} estimated {set(el['verdict'])}"})
            continue
        # cuBLAS holds its workspaces from the first matmul on: in a CUDA line's allocated peak, not an estimate's
        wsa = 0 if device == "cpu" else workspace_allocated_bytes(gpu.compute_capability, gpu.software, gpu.arch)
        alloc = {ph: (el.loc[ph, "peak_allocated_bytes"] + (0 if ph == "setup" else wsa))
                 / ml.loc[ph, "peak_allocated_bytes"] for ph in PHASES}
        worst = max(alloc, key=lambda ph: abs(alloc[ph] - 1))
        m_res = ml["peak_reserved_bytes"].astype(float).max() if device != "cpu" else \
            ml["simulated_reserved_bytes"].astype(float).max()
        ws = workspace_bytes(gpu.compute_capability, gpu.software, gpu.arch) if device != "cpu" else 0
        need = (el["simulated_reserved_bytes"].astype(float).max() + ws) / m_res
        tp = throughput(Ev(ef.loc[[e_id]]))
        t = update_time(tp, gpu, m["precision"], int(m["micro_batch"]), int(m["seq_len"]), int(m["grad_accum"]),
                        1, catalog, "single", catalog.offers[0])
        measured_s = float(m["update_s"])
        rows.append({
            "config": label(m), "alloc_ratio": round(max(alloc.values(), key=lambda r: abs(r - 1)), 4),
            "alloc_worst_phase": worst, "need_over_reserved": round(need, 4),
            "measured_ms": round(measured_s * 1e3, 2), "planned_ms": f"{t.low_s * 1e3:.1f}–{t.high_s * 1e3:.1f}",
            "point_ms": None if t.point_s is None else round(t.point_s * 1e3, 2),
            "inside": bool(t.low_s <= measured_s <= t.high_s),
            "point_error": None if t.point_s is None else round(t.point_s / measured_s - 1, 4)})
    return rows


def label(r) -> str:
    w = str(r["workload"]).split("/")[-1]
    return f"{w} mb{int(r['micro_batch'])}×{int(r['seq_len'])} {r['precision']}{' ckpt' if r['checkpointing'] else ''}"


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return {"configurations": len(rows), "failed": len(rows)}
    alloc = [abs(r["alloc_ratio"] - 1) for r in ok]
    need = [r["need_over_reserved"] for r in ok]
    points = [abs(r["point_error"]) for r in ok if r["point_error"] is not None]
    return {"configurations": len(rows), "failed": len(rows) - len(ok),
            "allocated_within_5pct": f"{sum(a <= 0.05 for a in alloc)}/{len(ok)} (max error {max(alloc):.1%})",
            "need_in_1.00_1.10": f"{sum(1.0 <= n <= 1.10 for n in need)}/{len(ok)} (min {min(need):.3f}, "
                                 f"max {max(need):.3f}; below 1.00: {sum(n < 1 for n in need)})",
            "time_inside_range": f"{sum(r['inside'] for r in ok)}/{len(ok)}",
            "point_within_15pct": f"{sum(p <= 0.15 for p in points)}/{len(points)} (median error "
                                  f"{statistics.median(points) if points else float('nan'):.1%})"}


TRACE = """
import json, sys
sys.path.insert(0, {root!r})
import torch
# Allocation events only: context=None records no stacks (C++ stacks' symbolization can take minutes)
torch.cuda.memory._record_memory_history(context=None, stacks="python", max_entries=2_000_000)
from planner.records import ProbeConfig
from planner.models.allocator import replay_cuda_trace
from probes.pilot import Pilot
cfg = ProbeConfig(**{cfg!r})
Pilot(cfg, {tmp!r}, lambda k, x: None, "r-trace", "p").run(("setup", "first_step", "steady", "eval"))
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
trace = snap["device_traces"][torch.cuda.current_device()]
out = replay_cuda_trace(trace)
out["max_memory_reserved"] = torch.cuda.max_memory_reserved()
out["entries"] = len(trace)
print(json.dumps(out))
"""


def allocator_traces(grid) -> list[dict]:
    out = []
    for cfg in configs("cuda", "measured", "", grid):
        with tempfile.TemporaryDirectory() as tmp:
            code = TRACE.format(root=str(ROOT), cfg={k: v for k, v in cfg.__dict__.items()}, tmp=tmp)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
        if r.returncode:
            out.append({"config": cfg.label(), "error": r.stderr.strip().splitlines()[-1][:300]})
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        res["config"] = cfg.label()
        res["simulated_over_real"] = round(res["simulated_peak_reserved"] / res["real_peak_reserved"], 4)
        out.append(res)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="four tiny built-in configurations")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from tabulate import tabulate

    from planner.ledger import read_lines
    from probes.runner import run_grid

    grid = QUICK if args.quick else GRID
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"no CUDA device (torch {torch.__version__}): nothing to measure; --device cpu checks the plumbing")
            return
    catalog, gpu, target, name = device_facts(args.device)
    print(f"device: {name}; catalog GPU {gpu.id if gpu else None}; estimates for kernel target {target}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        quiet = lambda m: None  # noqa: E731
        run_grid(configs(args.device, "measured", "", grid), f"{tmp}/m.db", progress=quiet, timeout_s=300)
        run_grid(configs("cpu", "estimated", target, grid), f"{tmp}/e.db", progress=quiet, timeout_s=300)
        rows = compare(read_lines(f"{tmp}/m.db"), read_lines(f"{tmp}/e.db"), catalog, gpu, args.device)
    print(tabulate(rows, headers="keys", tablefmt="github"))
    figures = {"device": name, "target": target, "rows": rows, "summary": summary(rows)}
    print(json.dumps(figures["summary"], indent=2))
    if args.device.startswith("cuda"):
        traces = allocator_traces(grid[1:3])
        print(tabulate(traces, headers="keys", tablefmt="github"))
        figures["allocator_traces"] = traces
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
