import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests run the same examples on every run (CI included): a failing example is a bug to fix, found again
# by the next run, never a red CI that a rerun turns green. HYPOTHESIS_PROFILE=explore draws new ones.
settings.register_profile("rentplan", derandomize=True, database=None)
settings.register_profile("explore", max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "rentplan"))

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORKLOADS = str(Path(__file__).resolve().parent / "workloads.py")
TINY = {"layers": 1, "d_model": 32, "heads": 2, "vocab": 64}


def start_hung_pilot(command: str, ledger: str, lines: int, *extra: str):
    """`planner COMMAND` of tests/workloads.py's die_in (a tiny gpt that hangs in eval) as a process, returned once
    the ledger holds `lines` lines and the workers are stuck in eval (a Ctrl-C test's starting point)."""
    import subprocess
    import time

    from planner.ledger import read_lines

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "planner", command, "--ledger", ledger, "-w", f"{WORKLOADS}:die_in",
            "-p", "how=hang", "-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64",
            "--seq-len", "16", *extra]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if os.path.exists(ledger) and len(read_lines(ledger)) >= lines:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    return proc


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run benchmarks/gpu_check.sh on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ledger_path(tmp_path):
    return str(tmp_path / "ledger.db")
