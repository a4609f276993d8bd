"""CUDA readings that mean what they say, checked on a CPU machine with faked CUDA counters: the numbers a GPU run
would read are set by the test, and the line must carry the right ones (and say what they leave out)."""

import random
import types

import pytest
from click.testing import CliRunner

torch = pytest.importorskip("torch")

GiB = 2**30


class FakeCuda:
    """torch.cuda's counters as a GPU process would read them after an earlier, failed attempt at a larger batch:
    its peaks and OOM count are still in the process-wide statistics."""

    def __init__(self, monkeypatch):
        self.allocated, self.reserved = 2 * GiB, 3 * GiB
        self.max_allocated, self.max_reserved, self.ooms = 10 * GiB, 12 * GiB, 3
        self.free, self.total = 60 * GiB, 80 * GiB
        self.events: list[str] = []
        c = torch.cuda
        for name, fn in {
            "is_available": lambda: True, "device_count": lambda: 1, "current_device": lambda: 0,
            "synchronize": lambda device=None: self.events.append("synchronize"),
            "empty_cache": lambda: self.events.append("empty_cache"),
            "reset_peak_memory_stats": lambda device=None: self._reset(),
            "memory_stats": lambda device=None: {"num_ooms": self.ooms},
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.max_allocated,
            "memory_reserved": lambda device=None: self.reserved,
            "max_memory_reserved": lambda device=None: self.max_reserved,
            "mem_get_info": lambda device=None: (self.free, self.total),
        }.items():
            monkeypatch.setattr(c, name, fn)

    def _reset(self):
        self.max_allocated, self.max_reserved = self.allocated, self.reserved


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def test_a_callback_setup_line_reads_what_is_held_not_the_process_peak(fake_cuda, monkeypatch, tmp_path):
    """The user's Trainer tried a larger batch first (OOM'd 3 times, 10 GiB peak): the setup line is what the
    model holds when the recorder begins, not that attempt's peak, and counts none of its OOMs."""
    import probes.observe as observe

    monkeypatch.setattr(observe, "environment", lambda device: {
        "device": str(device), "device_name": "Fake H100", "device_total_bytes": 80 * GiB, "torch_version": "x",
        "cuda_version": "13.0", "host": "h"})
    rec = observe.PhaseRecorder(str(tmp_path / "l.db"), workload="w", source="callback")
    rec.begin(torch.nn.Linear(4, 4), "cuda:0", micro_batch=2, seq_len=8)
    assert rec._setup["peak_allocated_bytes"] == 2 * GiB  # allocated now, not max_memory_allocated's 10 GiB
    assert rec._setup["peak_reserved_bytes"] == 3 * GiB
    assert rec._setup["baseline_allocated_bytes"] == 2 * GiB
    assert rec._setup["num_ooms_delta"] is None  # setup was not watched: the 3 earlier OOMs are not its
    assert rec._setup["context_bytes"] == 80 * GiB - 60 * GiB - 3 * GiB
    # the first watched phase starts from reset peaks and counts OOMs from here
    fake_cuda.ooms += 1
    reading = rec.read()
    assert reading["num_ooms_delta"] == 1 and reading["peak_allocated_bytes"] == 2 * GiB


def test_a_campaign_clock_waits_for_the_gpu_before_reading_the_time(fake_cuda, monkeypatch):
    from probes import campaign

    monkeypatch.setattr(campaign.time, "perf_counter", lambda: fake_cuda.events.append("clock") or 1.0)
    campaign.clock(torch.device("cuda", 0))
    assert fake_cuda.events == ["synchronize", "clock"]
    fake_cuda.events.clear()
    campaign.clock(torch.device("cpu"))
    assert fake_cuda.events == ["clock"]


def test_release_between_runs_empties_the_allocator_on_cuda_only(fake_cuda):
    from probes.campaign import release

    release("cuda:0")
    assert fake_cuda.events == ["synchronize", "empty_cache"]
    fake_cuda.events.clear()
    release("cpu")
    assert fake_cuda.events == []


def test_the_next_variant_starts_after_a_release_when_one_fails(monkeypatch, tmp_path):
    """Written from a user's campaign: the first variant errors (its loss raises), the second trains; between them
    the runner releases what the first left."""
    import yaml

    from planner.inputs.campaign_spec import load_campaign
    from probes import campaign
    from tests.conftest import TINY, WORKLOADS

    order: list[str] = []
    real_run_variant = campaign.run_variant
    monkeypatch.setattr(campaign, "release", lambda device: order.append(f"release {device}"))

    def run_variant(camp, v, *args, **kw):
        order.append(f"run {v.id}")
        return real_run_variant(camp, v, *args, **kw)

    monkeypatch.setattr(campaign, "run_variant", run_variant)
    spec = tmp_path / "c.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "c", "workload": f"{WORKLOADS}:raises", "params": TINY, "precision": "fp32", "seq_len": 8,
        "effective_batch": 2, "updates": 2, "eval": {"every_updates": 2, "examples": 2, "seq_len": 8},
        "setup_hours": 0.1,
        "variants": [{"id": "a", "lr": 1e-3, "priority": 1}, {"id": "b", "lr": 2e-3, "priority": 2}]}))
    camp = load_campaign(str(spec))
    outcomes = campaign.run_campaign(camp, camp.variants, None, str(tmp_path / "l.db"), str(tmp_path / "runs"),
                                     "cpu", None, "single", say=lambda m: None, echo=lambda m: None)
    assert outcomes == ["error", "error"]
    assert order == ["run a", "release cpu", "run b", "release cpu"]


def test_cudnn_benchmark_is_recorded_and_said_on_the_lines_it_affects(monkeypatch):
    from probes.census import precision_flags
    from probes.memory import reading_notes

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert precision_flags()["cudnn_benchmark"] is True
    cuda = torch.device("cuda", 0)
    assert "cudnn.benchmark on" in reading_notes(cuda, "first_step", "adamw")
    assert "cudnn.benchmark" not in reading_notes(cuda, "steady", "adamw")  # the algorithms are chosen by then
    assert reading_notes(torch.device("cpu"), "first_step", "adamw") == ""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert precision_flags()["cudnn_benchmark"] is False
    assert reading_notes(cuda, "first_step", "adamw") == ""


def test_paged_optimizer_state_is_said_to_be_outside_the_counters():
    from probes.memory import reading_notes

    note = reading_notes(torch.device("cuda", 0), "steady", "paged_adamw8bit")
    assert "outside torch's allocator" in note and "--cap does not bound it" in note
    assert reading_notes(torch.device("cuda", 0), "eval", "paged_adamw8bit") == ""  # no optimizer state there
    assert reading_notes(torch.device("cuda", 0), "steady", "adamw8bit") == ""


TF32_CASES = {  # what a workload does -> (matmul precision recorded, cuDNN TF32 recorded)
    "pass": ("highest", True),  # PyTorch's defaults
    "torch.backends.cudnn.allow_tf32 = False": ("highest", False),
    "torch.backends.cuda.matmul.allow_tf32 = True": ("high", True),
    "torch.set_float32_matmul_precision('high')": ("high", True),
    "torch.set_float32_matmul_precision('medium')": ("medium", True),
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'": ("high", True),  # then the legacy getters raise
    "torch.backends.fp32_precision = 'tf32'": ("high", True),
    "torch.backends.fp32_precision = 'bf16'": ("medium", False),
    "torch.backends.fp32_precision = 'ieee'": ("highest", False),
    "torch.backends.cudnn.conv.fp32_precision = 'ieee'": ("highest", False),
}

TF32_SCRIPT = """
import json, os, sys
import torch
from probes.census import precision_flags
for case in json.loads(sys.argv[1]):
    pid = os.fork()  # each case in a fresh copy of the process: a switch once set stays set
    if pid == 0:
        try:
            exec(case)
            print(json.dumps([case, precision_flags()]), flush=True)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
"""


def test_tf32_is_recorded_as_set_through_either_api():
    """torch.backends.cuda.matmul.fp32_precision = "tf32" (the API PyTorch's notes now point to) makes the legacy
    getters raise ("mix of the legacy and new APIs"), and the legacy setters leave the new getters at "none": the
    census reads whichever API is in force and records what the GPU would run, without raising."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    if not hasattr(torch.backends, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has only the legacy API")
    r = subprocess.run([sys.executable, "-c", TF32_SCRIPT, json.dumps(list(TF32_CASES))], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    seen = {case: (f["float32_matmul_precision"], f["cudnn_allow_tf32"])
            for case, f in map(json.loads, r.stdout.splitlines())}
    assert seen == TF32_CASES, r.stderr[-2000:]


def test_more_ranks_than_gpus_is_refused_before_anything_runs(fake_cuda, tmp_path, monkeypatch):
    from planner.cli import cli

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["probe", "--device", "cuda", "--strategy", "ddp", "--nproc", "2", "--ledger", "l.db",
                                 "--micro-batch", "1", "--seq-len", "8"])
    assert r.exit_code == 1, r.output
    assert "Error: --nproc 2: this machine has 1 CUDA device(s)" in r.output
    assert list(tmp_path.iterdir()) == []


def test_each_rank_resumes_its_own_generators(monkeypatch):
    """A DDP checkpoint holds every rank's RNG states; rank 1 takes back rank 1's, not rank 0's."""
    from probes import checkpoint

    states = [torch.full((16,), r, dtype=torch.uint8) for r in range(2)]
    set_to = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: states[device.index].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, device=None: set_to.update({device.index: t}))
    gathered = []

    def every_rank(own):  # what all_gather_object gives each rank: every rank's dict, in rank order
        gathered.append(own)
        return [{**own, "cuda": states[r].clone(), "torch": torch.get_rng_state()} for r in range(2)]

    import probes.distributed

    monkeypatch.setattr(probes.distributed, "every_rank", every_rank)
    rank0 = types.SimpleNamespace(device=torch.device("cuda", 0), rank=0, world=2, fake=False)
    rng = checkpoint.rng_state(rank0)
    assert [int(r["cuda"][0]) for r in rng["ranks"]] == [0, 1]
    py = random.getstate()
    rank1 = types.SimpleNamespace(device=torch.device("cuda", 1), rank=1, world=2, fake=False)
    checkpoint.restore_rng(rank1, rng)
    assert int(set_to[1][0]) == 1  # rank 1's own state (rank 0's would be 0)
    assert random.getstate() == py
    # An older checkpoint (rank 0's states only) still resumes, with rank 0's states
    checkpoint.restore_rng(rank1, {k: v for k, v in rng.items() if k != "ranks"})
    assert int(set_to[1][0]) == 0


def test_a_grid_files_device_is_the_one_checked(fake_cuda, tmp_path, monkeypatch):
    """`probe --grid grid.yaml` whose file says the device: the check reads it (the command line's --device no longer
    stands in for it with a default of auto)."""
    from planner.commands.common import spec_from_options
    from planner.inputs.grid import GridSpec

    (tmp_path / "grid.yaml").write_text("device: cuda\nstrategy: ddp\nnproc: 3\nmicro_batch: 1\nseq_len: 8\n")
    with pytest.raises(Exception, match="--nproc 3: this machine has 1 CUDA device"):
        spec_from_options({"grid_file": str(tmp_path / "grid.yaml")})
    (tmp_path / "grid.yaml").write_text("device: cpu\nstrategy: ddp\nnproc: 3\nmicro_batch: 1\nseq_len: 8\n")
    spec = spec_from_options({"grid_file": str(tmp_path / "grid.yaml")})
    assert isinstance(spec, GridSpec) and spec.device == "cpu" and spec.nproc == 3
    spec = spec_from_options({"grid_file": str(tmp_path / "grid.yaml"), "device": "auto", "nproc": 1,
                              "strategy": "single"})
    assert spec.device == "cuda"  # the command line still wins where it is given


def test_ranks_from_another_gpu_than_the_first_are_refused(fake_cuda, monkeypatch):
    from planner.errors import InputError
    from probes.pilot import available_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert available_device("cuda", 4) == "cuda"
    with pytest.raises(InputError, match="rank r runs on cuda:r"):
        available_device("cuda:1", 2)
    assert available_device("cuda:1", 1) == "cuda:1"
