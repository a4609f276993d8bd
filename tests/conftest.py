import functools
import os
import signal
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

    import pandas as pd

    from planner.errors import LedgerError
    from planner.ledger import read_lines

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "planner", command, "--ledger", ledger, "-w", f"{WORKLOADS}:die_in",
            "-p", "how=hang", "-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64",
            "--seq-len", "16", *extra]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90

    def written() -> int:
        try:
            return len(read_lines(ledger)) if os.path.exists(ledger) else 0
        except (LedgerError, pd.errors.DatabaseError):  # the probe is creating it: the file exists before its tables
            return 0

    while time.monotonic() < deadline:
        if written() >= lines:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    return proc


def rentplan(tmp_path: Path, *args: str, timeout: float = 300):
    """The CLI in a fresh process, as a user starts it, in tmp_path, with tests/workloads.fork_witness's log there."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT), "RENTPLAN_FORK_LOG": str(tmp_path / "forks.txt")}
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def builders(tmp_path: Path) -> list[tuple[int, bool]]:
    """(pid, in a bad CUDA fork?) for every process that built tests/workloads.fork_witness's model."""
    log = tmp_path / "forks.txt"
    rows = [ln.split() for ln in log.read_text().splitlines()] if log.exists() else []
    return [(int(pid), bad == "True") for pid, bad in rows]


@functools.cache
def has_cuda() -> bool:
    """Asked in a child process: torch.cuda.is_available() in this one would poison every fork the tests make under
    a CUDA build (torch/csrc/cuda/Module.cpp, poison_fork). A CPU-only build answers from its build flag."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.backends.cuda.is_built():
        return False
    import subprocess

    r = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True)
    return r.stdout.strip() == "True"


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


def pytest_configure(config):
    # A suite started in the background (`make test-slow &`, nohup, a CI runner's shell without job control) inherits
    # SIGINT ignored, and so would every command the Ctrl-C tests start: they would wait out their timeouts, as a
    # background rehearsal of .ci/run did. A terminal's Ctrl-C is what they test, so the commands get its handler.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
