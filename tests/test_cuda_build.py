"""Every path that builds the user's model in another process, run as a user runs it, under the torch build a GPU
user has (`make test-cuda-build`: PyTorch's default Linux wheel, a CUDA build; it runs on this CPU too).

In a CUDA build, a process forked after its parent asked CUDA anything (torch.cuda.is_available(), an optimizer
step, FakeTensorMode, the elastic launcher's NUMA check) is "in a bad fork" (torch/csrc/cuda/Module.cpp,
poison_fork) and its first CUDA call raises: on a GPU every probe would fail. A CPU machine sees it through
torch.cuda._is_in_bad_fork(), which tests/workloads.fork_witness writes for each process that builds the model.
Under the CPU build these tests run the same paths (nothing can be poisoned there); `make test-cuda-build` sets
RENTPLAN_CUDA_BUILD=1, and then the first test proves the build is the CUDA one.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import TINY, WORKLOADS, builders, rentplan
from tests.factories import campaign_yaml

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cudabuild

TINY_P = [x for k, v in TINY.items() for x in ("-p", f"{k}={v}")]


def assert_clean(tmp_path: Path, r: subprocess.CompletedProcess, at_least: int, ledger: str = "l.db"):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    built = builders(tmp_path)
    assert len({pid for pid, _ in built}) >= at_least, built
    assert not [pid for pid, bad in built if bad], f"processes in a bad CUDA fork: {built}"
    if ledger:
        from planner.ledger import read_lines

        lines = read_lines(str(tmp_path / ledger))
        assert len(lines) and set(lines["verdict"]) == {"ok"}, lines[["phase", "verdict", "detail"]].to_string()


def test_the_build_under_test_is_the_one_asked_for():
    """`make test-cuda-build` must really run the CUDA build: otherwise every test below passes vacuously."""
    if os.environ.get("RENTPLAN_CUDA_BUILD") != "1":
        pytest.skip("the CPU build (make test-cuda-build runs this set under PyTorch's CUDA wheel)")
    assert torch.backends.cuda.is_built() and torch.version.cuda, torch.__version__


def test_probe_workers(tmp_path):
    r = rentplan(tmp_path, "probe", "--ledger", "l.db", "-w", f"{WORKLOADS}:fork_witness", *TINY_P,
                 "--micro-batch", "2", "--seq-len", "8", "--steady-updates", "3")
    assert_clean(tmp_path, r, at_least=2)  # the pilot's worker and resume's fresh process


def test_find_max_micro_batch_under_a_cap(tmp_path):
    r = rentplan(tmp_path, "probe", "--ledger", "l.db", "-w", f"{WORKLOADS}:fork_witness", *TINY_P,
                 "--find", "max-micro-batch", "--cap", "1GiB", "--seq-len", "8", "--steady-updates", "3")
    assert_clean(tmp_path, r, at_least=3)  # estimates, then real probes


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_of_a_distributed_probe(tmp_path, strategy):
    r = rentplan(tmp_path, "probe", "--ledger", "l.db", "-w", f"{WORKLOADS}:fork_witness", *TINY_P,
                 "--micro-batch", "2", "--seq-len", "8", "--steady-updates", "3", "--strategy", strategy,
                 "--nproc", "2", "--device", "cpu")  # gloo ranks: a one-GPU machine runs this set too
    assert_clean(tmp_path, r, at_least=4)  # 2 ranks, then 2 resuming ranks


def test_estimates_side_by_side_with_the_new_tf32_switch(tmp_path):
    """The workload sets torch.backends.cuda.matmul.fp32_precision (after which the legacy getters raise): no
    error line, and the steady line records TF32."""
    r = rentplan(tmp_path, "estimate", "--ledger", "l.db", "-w", f"{WORKLOADS}:tf32_new_api", *TINY_P,
                 "--micro-batch", "1,2", "--seq-len", "8", "--precision", "fp32", "--target", "h100_sxm",
                 "--jobs", "2")
    assert_clean(tmp_path, r, at_least=0)
    from planner.ledger import read_lines

    lines = read_lines(str(tmp_path / "l.db"))
    profiles = [json.loads(p) for p in lines.loc[lines["phase"] == "steady", "op_profile_json"]]
    assert len(profiles) == 2
    assert all(p[t]["float32_matmul_precision"] == "high" for p in profiles for t in p)


def test_estimate_of_the_witness(tmp_path):
    r = rentplan(tmp_path, "estimate", "--ledger", "l.db", "-w", f"{WORKLOADS}:fork_witness", *TINY_P,
                 "--micro-batch", "1,2", "--seq-len", "8", "--target", "h100_sxm", "--jobs", "2")
    assert_clean(tmp_path, r, at_least=2)


def test_resume_check(tmp_path):
    r = rentplan(tmp_path, "resume-check", "-w", f"{WORKLOADS}:fork_witness", *TINY_P, "--seq-len", "8",
                 "--updates", "4", "--at", "2", "--at-micro", "1", "--grad-accum", "2")
    assert_clean(tmp_path, r, at_least=3, ledger="")  # uninterrupted, stopped, resumed: three fresh processes
    assert "exact" in r.stdout.lower(), r.stdout


SCRIPT = '''import os, torch
with open(os.environ["RENTPLAN_FORK_LOG"], "a") as f:
    f.write(f"{os.getpid()} {torch.cuda._is_in_bad_fork()}\\n")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
opt = torch.optim.AdamW(model.parameters())
for step in range(4):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
'''


def test_a_plain_script(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    r = rentplan(tmp_path, "probe", "--ledger", "l.db", "--script", "train.py", "-w", "script:train")
    assert_clean(tmp_path, r, at_least=1, ledger="")
    from planner.ledger import read_lines

    lines = read_lines(str(tmp_path / "l.db"))
    assert {"setup", "first_step", "steady"} <= set(lines["phase"]) and "error" not in set(lines["verdict"])


def test_verify_pilot_and_campaign_run(tmp_path):
    """The order a plan writes, verified on this machine (its pilot runs in a worker), then the campaign run."""
    params = {**TINY}
    r = rentplan(tmp_path, "probe", "--ledger", "l.db", "-w", f"{WORKLOADS}:fork_witness", "--device", "cpu",
                 *TINY_P, "--micro-batch", "1,2", "--seq-len", "16", "--precision", "bf16", "--steady-updates", "3")
    assert_clean(tmp_path, r, at_least=4)
    (tmp_path / "c.yaml").write_text(campaign_yaml(
        workload=f"{WORKLOADS}:fork_witness", params=params, seq_len=16, effective_batch=4, updates=4,
        eval={"every_updates": 2, "examples": 4, "seq_len": 16}, setup_hours=0.1,
        variants=[{"id": "control", "lr": 1e-3, "priority": 1}]))
    r = rentplan(tmp_path, "plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "out", "--offer", "local")
    assert r.returncode == 0, r.stdout + r.stderr
    before = len({pid for pid, _ in builders(tmp_path)})
    r = rentplan(tmp_path, "verify", "out/order.json", "--ledger", "verify.db")
    assert "adopt: every check passed" in r.stdout, r.stdout + r.stderr
    assert_clean(tmp_path, r, at_least=before + 1, ledger="verify.db")
    r = rentplan(tmp_path, "campaign", "run", "c.yaml", "--out", "runs", "--ledger", "runs.db")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not [pid for pid, bad in builders(tmp_path) if bad]
