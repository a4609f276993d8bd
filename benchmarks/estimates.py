"""Issue 5 and 6 figures: the 7B-shape estimate (one process, and rank 0 of FSDP × 8), held-out memory-model error,
search probes, false-fit rate.

    python benchmarks/estimates.py [--out figures.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.inputs.grid import GridSpec  # noqa: E402
from planner.models.memory_model import build_model  # noqa: E402
from planner.records import ProbeConfig  # noqa: E402

SMALL = {"layers": 2, "d_model": 64, "heads": 2, "vocab": 128}
LLAMA7B = {"layers": 32, "d_model": 4096, "ffn": 11008, "heads": 32, "vocab": 32000}

SEVEN_B = """
import json, resource, sys, time
sys.path.insert(0, %r)
import torch
from planner.records import ProbeConfig
from probes.pilot import Pilot
n = %d
if n > 1:
    from probes.distributed import init_fake_process_group
    init_fake_process_group(n)
cfg = ProbeConfig(params_json=json.dumps(%r), micro_batch=1, seq_len=2048, eval_seq_len=2048, precision="bf16",
                  mode="estimated", strategy="fsdp" if n > 1 else "single", world_size=n)
out = {}
p = Pilot(cfg, "/tmp", lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None, "r", "p")
p.run(("setup", "first_step", "steady"))
print(json.dumps({"first_step_s": out["first_step"]["seconds"], "setup_s": out["setup"]["seconds"],
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "params": out["setup"]["param_count"], "param_bytes": out["setup"]["param_bytes"],
                  "optimizer_state_bytes": out["first_step"]["optimizer_state_bytes"],
                  "first_step_peak_bytes": out["first_step"]["peak_allocated_bytes"],
                  "flops_per_update": out["steady"]["flops_per_update"]}))
"""


def seven_b_fsdp(n: int = 8) -> dict:
    """The same model, rank 0 of n under FSDP on a fake process group: states / n per rank."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", SEVEN_B % (str(ROOT), n, LLAMA7B)], capture_output=True, text=True,
                       timeout=600)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    res["GiB"] = {k: round(v / 2**30, 2) for k, v in res.items() if k.endswith("bytes") and isinstance(v, int)}
    return res


def seven_b() -> dict:
    r = subprocess.run([sys.executable, "-c", SEVEN_B % (str(ROOT), 1, LLAMA7B)], capture_output=True, text=True,
                       timeout=600)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    n_tensors = 2 + 32 * 12 + 3  # tok, pos; 12 per block; final norm (2) and head: one fp32 step counter each
    states = res["params"] * 4 * 2 + 4 * n_tensors
    weights_grads_state = res["param_bytes"] * 2 + states
    res.update({
        "independent_count_bytes": weights_grads_state,
        "optimizer_state_matches_count": res["optimizer_state_bytes"] == states,
        "activations_and_temporaries_bytes": res["first_step_peak_bytes"] - weights_grads_state,
        "GiB": {k: round(v / 2**30, 2) for k, v in res.items() if k.endswith("bytes") and isinstance(v, int)},
    })
    return res


def pilot_peak(mb: int, seq: int, cap: int | None = None, mode: str = "measured") -> dict:
    from probes.pilot import TRAIN_WORKER_PHASES, Pilot

    cfg = ProbeConfig(params_json=json.dumps(SMALL, sort_keys=True), micro_batch=mb, seq_len=seq, eval_seq_len=seq,
                      eval_micro_batch=mb, cap="bench" if cap else "", cap_bytes=cap, mode=mode)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        Pilot(cfg, tmp, lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None, f"r{mb}-{seq}",
              "p").run(TRAIN_WORKER_PHASES)
    return out


def model_error() -> dict:
    import pandas as pd

    grid = [(mb, s) for mb in (1, 2, 4, 6, 8) for s in (64, 128, 192, 256)]
    fit_on = [(1, 64), (8, 128), (4, 256), (8, 256)]
    lines = {k: pilot_peak(*k) for k in grid}
    df = pd.DataFrame([{**ln} for k in fit_on for ln in lines[k].values()])
    df["simulated_reserved_bytes"] = None  # the fit on allocated bytes, which the CPU cap also counts
    model = build_model(df, 1.0)
    errs, need_errs, cap_rows = [], [], []
    for k in grid:
        if k in fit_on:
            continue
        mb, s = k
        actual_need = max(ln["peak_allocated_bytes"] for ln in lines[k].values())
        pred_need = model.need(mb, s, mb, s).bytes
        need_errs.append(abs(pred_need - actual_need) / actual_need * 100)
        for phase in ("first_step", "steady", "eval"):
            a = lines[k][phase]["peak_allocated_bytes"]
            errs.append(abs(model.fits[phase].predict(mb, s) - a) / a * 100)
        cap_rows.append((k, pred_need, actual_need))
    # False fits: held-out configurations the model says fit under a cap, run for real under that cap.
    needs = sorted(x[2] for x in cap_rows)
    cap = int(needs[len(needs) // 2])
    false_fit, predicted_fit = 0, 0
    for (mb, s), pred, _ in cap_rows:
        if pred <= cap:
            predicted_fit += 1
            res = pilot_peak(mb, s, cap=cap)
            false_fit += any(ln["verdict"] == "oom" for ln in res.values())
    return {"fit_on": fit_on, "held_out": len(cap_rows),
            "phase_error_pct": {"median": round(statistics.median(errs), 3), "max": round(max(errs), 3)},
            "need_error_pct": {"median": round(statistics.median(need_errs), 3), "max": round(max(need_errs), 3)},
            "false_fit": {"cap_bytes": cap, "predicted_fit": predicted_fit, "failed_under_cap": false_fit,
                          "rate": round(false_fit / predicted_fit, 3) if predicted_fit else None}}


def search() -> dict:
    from probes.search import doubling_search, find_max

    out = {}
    for dim, fixed in (("max-micro-batch", {"seq_len": [64]}), ("max-seq-len", {"micro_batch": [2]})):
        spec = GridSpec(params=SMALL, cap="60MiB", cap_bytes=60 * 2**20, **fixed)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            ours = find_max(spec, dim, str(Path(tmp) / "a.db"), progress=lambda m: None)
            t1 = time.perf_counter()
            base = doubling_search(spec, dim, str(Path(tmp) / "b.db"), progress=lambda m: None)
            t2 = time.perf_counter()
        out[dim] = {"ours": {"best": ours.best, "failed_above": ours.failed_above, "real_probes": ours.real_probes,
                             "estimates": ours.estimate_probes, "wall_s": round(t1 - t0, 1)},
                    "doubling_then_binary": {"best": base.best, "failed_above": base.failed_above,
                                             "real_probes": base.real_probes, "wall_s": round(t2 - t1, 1)},
                    "probe_ratio": round(ours.real_probes / base.real_probes, 3)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    figures = {"seven_b_first_step_estimate": seven_b(), "seven_b_fsdp8_rank0_estimate": seven_b_fsdp(8),
               "memory_model": model_error(), "search": search()}
    print(json.dumps(figures, indent=2, default=str))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
