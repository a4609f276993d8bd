"""How long the whole estimate of a 7B-shaped model takes (all 7 phases, every worker), against torch's own
MemTracker sizing one update of the same model under fake tensors, measured in the same run; and peak RSS.

    python benchmarks/estimate_speed.py [--layers 32] [--repeat 3] [--out figures.json]
    python benchmarks/estimate_speed.py --grid [--layers 32] [--out figures.json]

--grid: the grid people wait for (#26): `rentplan estimate --micro-batch 1,2,4,8 --seq-len 1024,2048 --target sm80+`
(8 configurations, all 7 phases, the command as a user runs it: estimates side by side, one per core; then again
with --jobs 1) against 8 MemTracker runs of one update each at the same shapes, one after the other in one run;
it prints the ratios (target: at most 0.15).

Both run in fresh processes on this machine: ours through run_grid (the path `rentplan estimate` takes,
forkserver start and warm-up included) and again in one warm process (every phase, and the process's peak
RSS), MemTracker on a model built under FakeTensorMode (its build is not timed). With --repeat N the three
run in turn N times (so a busy machine slows all three alike) and the ratios are the medians of each round's.
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

SHAPE = {"layers": 32, "d_model": 4096, "ffn": 11008, "heads": 32, "vocab": 32000}

OURS = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from planner.records import ProbeConfig
from planner.ledger import read_lines
from probes.runner import run_grid, start_workers
cfg = ProbeConfig(params_json=json.dumps({shape!r}, sort_keys=True), micro_batch=1, seq_len=2048, eval_seq_len=2048,
                  precision="bf16", mode="estimated", target="sm80+")
t0 = time.perf_counter()
run_grid([cfg], {ledger!r}, progress=lambda m: None)
wall = time.perf_counter() - t0
df = read_lines({ledger!r})
print(json.dumps({{"wall_s": wall, "verdicts": sorted(set(df["verdict"])),
                  "phase_s": dict(zip(df["phase"], df["seconds"].round(2))),
                  "first_step_peak_bytes": int(df[df.phase == "first_step"]["peak_allocated_bytes"].iloc[0])}}))
"""

IN_PROCESS = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import probes.runner, probes.warm  # what the forkserver has loaded before a worker starts
from planner.records import PHASES, ProbeConfig
from probes.pilot import Pilot
cfg = ProbeConfig(params_json=json.dumps({shape!r}, sort_keys=True), micro_batch=1, seq_len=2048, eval_seq_len=2048,
                  precision="bf16", mode="estimated", target="sm80+")
t0 = time.perf_counter()
Pilot(cfg, {tmp!r}, lambda k, x: None, "r", "p").run(PHASES)
print(json.dumps({{"all_phases_s": time.perf_counter() - t0,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""

MEMTRACKER = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from probes.builtin import GPT
w = GPT(**{shape!r})
with FakeTensorMode(allow_non_fake_inputs=True):
    model = w.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    batch = w.make_batch("train", 0, {micro_batch}, {seq_len})
    mt = MemTracker()
    mt.track_external(model, opt)
    t0 = time.perf_counter()
    with mt:
        with torch.autocast("cpu", torch.bfloat16):
            loss = w.compute_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t0
peak = sum(v for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items() if k != "Total")
print(json.dumps({{"update_s": seconds, "peak_bytes": peak,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}}))
"""


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


GRID = {"micro_batch": (1, 2, 4, 8), "seq_len": (1024, 2048)}


def grid(shape: dict) -> dict:
    """The user's command (estimates side by side, one per core, and again with --jobs 1) against 8 MemTracker
    runs, each in a fresh process, timed here."""
    import os
    import time

    params = [a for k, v in shape.items() for a in ("-p", f"{k}={v}")]

    def ours(jobs: list[str]) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "planner.cli", "estimate", "-w", "builtin:gpt", *params,
                   "--micro-batch", ",".join(map(str, GRID["micro_batch"])),
                   "--seq-len", ",".join(map(str, GRID["seq_len"])), "--precision", "bf16", "--target", "sm80+",
                   "--ledger", str(Path(tmp) / "l.db"), *jobs]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=tmp,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            return time.perf_counter() - t0

    side_by_side, one_at_a_time = ours([]), ours(["--jobs", "1"])
    theirs = []
    for mb in GRID["micro_batch"]:
        for seq in GRID["seq_len"]:
            t0 = time.perf_counter()
            r = run(MEMTRACKER.format(root=str(ROOT), shape=shape, micro_batch=mb, seq_len=seq))
            theirs.append({"micro_batch": mb, "seq_len": seq, "process_s": round(time.perf_counter() - t0, 2),
                           "update_s": round(r["update_s"], 2)})
    total = sum(t["process_s"] for t in theirs)
    tracked = sum(t["update_s"] for t in theirs)
    from probes.runner import estimate_jobs

    return {"shape": shape, "grid": GRID, "jobs": estimate_jobs(8), "rentplan_estimate_s": round(side_by_side, 2),
            "rentplan_estimate_jobs1_s": round(one_at_a_time, 2), "memtracker_runs": theirs,
            "memtracker_total_s": round(total, 2), "memtracker_updates_s": round(tracked, 2),
            "ratio": round(side_by_side / total, 3), "ratio_jobs1": round(one_at_a_time / total, 3),
            "ratio_to_tracked_updates": round(side_by_side / tracked, 3),
            "target_ratio": 0.15, "torch": __import__("torch").__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--grid", action="store_true", help="the 8-configuration grid against 8 MemTracker runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = {**SHAPE, "layers": args.layers}
    if args.grid:
        figures = grid(shape)
        print(json.dumps(figures, indent=2))
        print(f"rentplan estimate, 8 configurations × 7 phases: {figures['rentplan_estimate_s']:.1f} s with "
              f"{figures['jobs']} side by side, {figures['rentplan_estimate_jobs1_s']:.1f} s one at a time; "
              f"8 MemTracker runs of one update: {figures['memtracker_total_s']:.1f} s as processes (ratio "
              f"{figures['ratio']:.3f}, one at a time {figures['ratio_jobs1']:.3f}), "
              f"{figures['memtracker_updates_s']:.1f} s in its tracked updates alone "
              f"(ratio {figures['ratio_to_tracked_updates']:.3f}); target ≤ 0.15")
        if args.out:
            Path(args.out).write_text(json.dumps(figures, indent=2))
        return
    rounds = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            ours = run(OURS.format(root=str(ROOT), shape=shape, ledger=str(Path(tmp) / "l.db")))
            worker = run(IN_PROCESS.format(root=str(ROOT), shape=shape, tmp=tmp))
        theirs = run(MEMTRACKER.format(root=str(ROOT), shape=shape, micro_batch=1, seq_len=2048))
        rounds.append({"rentplan_estimate_all_phases": ours, "in_one_warm_worker": worker,
                       "memtracker_one_update": theirs,
                       "ratio_ours_over_memtracker": round(ours["wall_s"] / theirs["update_s"], 3),
                       "ratio_warm_worker_over_memtracker": round(worker["all_phases_s"] / theirs["update_s"], 3),
                       "peak_agrees_with_memtracker": round(ours["first_step_peak_bytes"] / theirs["peak_bytes"], 6)})
    figures = {"shape": shape, "rounds": rounds,
               "median_ratio_ours_over_memtracker": statistics.median(r["ratio_ours_over_memtracker"] for r in rounds),
               "median_ratio_warm_worker_over_memtracker":
                   statistics.median(r["ratio_warm_worker_over_memtracker"] for r in rounds),
               "max_rss_bytes": max(r["in_one_warm_worker"]["max_rss_bytes"] for r in rounds),
               "target_ratio": 0.5, "rss_target_bytes": 2**30}
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
