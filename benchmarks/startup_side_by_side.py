"""Start-up time of a probe and an estimate, this checkout against another revision, side by side.

    python benchmarks/startup_side_by_side.py [--before REV] [--repeats 5]

Each round runs the same tiny command (one configuration of the built-in gpt, every phase) once from a
worktree of REV and once from this checkout, alternating which goes first, in fresh folders and fresh
processes (so each pays the forkserver's start and warm-up); prints the median wall time of each and their
ratio (this checkout ÷ REV). The interpreter is this one: run it with the CPU build's and the CUDA build's
Python to see both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64", "--seq-len", "16"]
COMMANDS = {"probe": ["probe", "--micro-batch", "2", "--steady-updates", "3", *TINY],
            "estimate": ["estimate", "--micro-batch", "2", "--target", "h100_sxm", *TINY]}


def timed(tree: Path, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "planner", *args, "--ledger", "l.db"], cwd=tmp, env=env,
                           capture_output=True, text=True)
        seconds = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--before", default="HEAD", help="the revision to compare with (a git worktree of it is made)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as wt:
        before = Path(wt) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before],
                       check=True, capture_output=True)
        try:
            print(f"torch {torch.__version__} (CUDA build: {torch.backends.cuda.is_built()}); {os.cpu_count()} cores; "
                  f"before = {args.before}, after = this checkout; {args.repeats} rounds each")
            for name, cmd in COMMANDS.items():
                times = {"before": [], "after": []}
                for i in range(args.repeats):
                    order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
                    for which in order:
                        times[which].append(timed(before if which == "before" else ROOT, cmd))
                b, a = statistics.median(times["before"]), statistics.median(times["after"])
                print(f"{name:9s} before {b:6.2f} s  after {a:6.2f} s  ratio after/before {a / b:.3f}  "
                      f"(runs: before {' '.join(f'{t:.2f}' for t in times['before'])}; "
                      f"after {' '.join(f'{t:.2f}' for t in times['after'])})")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)


if __name__ == "__main__":
    main()
