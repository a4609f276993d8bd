"""Probe overhead = wall time of a 12-configuration CPU probe of the built-in gpt ÷ the sum of its lines'
measured seconds (1.0 = every second spent measuring; target <= 1.5). Also reports the CPU tracker's own
cost: the same updates timed with and without the live-bytes tracker, side by side.

    python benchmarks/probe_overhead.py [--out figures.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.inputs.grid import GridSpec, build_grid  # noqa: E402
from planner.ledger import read_lines  # noqa: E402

PARAMS = {"layers": 4, "d_model": 256, "heads": 4, "vocab": 8192}


def overhead(device: str) -> dict:
    from probes.runner import run_grid

    spec = GridSpec(params=PARAMS, micro_batch=[1, 2, 4], seq_len=[128, 256], precision=["fp32", "bf16"],
                    device=device)
    configs = build_grid(spec)
    assert len(configs) == 12
    with tempfile.TemporaryDirectory() as tmp:
        ledger = str(Path(tmp) / "bench.db")
        t0 = time.perf_counter()
        run_grid(configs, ledger, progress=lambda m: None)
        wall = time.perf_counter() - t0
        df = read_lines(ledger)
    measured = float(df["seconds"].sum())
    return {"configs": 12, "lines": int(len(df)), "verdicts": df["verdict"].value_counts().to_dict(),
            "wall_s": round(wall, 2), "measured_s": round(measured, 2), "overhead_ratio": round(wall / measured, 3)}


def tracker_cost(reps: int = 7) -> dict:
    """Median update time with and without the tracker (same process, same batches, interleaved)."""
    import torch

    from planner.records import ProbeConfig
    from probes.builtin import GPT
    from probes.loop import Trainer
    from probes.memory import LiveTensorTracker

    cfg = ProbeConfig(params_json=json.dumps(PARAMS), micro_batch=4, seq_len=256, precision="fp32")
    trainer = Trainer(GPT(**PARAMS), cfg, torch.device("cpu"))
    trainer.train_update()
    plain, tracked = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        trainer.train_update()
        plain.append(time.perf_counter() - t0)
        with LiveTensorTracker():
            t0 = time.perf_counter()
            trainer.train_update()
            tracked.append(time.perf_counter() - t0)
    p, t = statistics.median(plain), statistics.median(tracked)
    return {"update_s_plain": round(p, 4), "update_s_tracked": round(t, 4), "tracker_ratio": round(t / p, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    figures = {"probe_overhead": overhead(args.device)}
    if args.device == "cpu":
        figures["cpu_tracker"] = tracker_cost()
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
