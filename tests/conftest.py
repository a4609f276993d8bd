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
