"""CUDA checks (skipped without a GPU; run by benchmarks/gpu_check.sh whenever a GPU is lent)."""

import dataclasses
import json

import pytest

from planner.ledger import read_lines
from planner.records import PHASES, ProbeConfig

pytestmark = pytest.mark.gpu
PARAMS = {"layers": 4, "d_model": 256, "heads": 4, "vocab": 8192}


def cfg(**kw):
    kw.setdefault("seq_len", 256)
    kw.setdefault("eval_seq_len", 512)
    return ProbeConfig(params_json=json.dumps(PARAMS, sort_keys=True), device="cuda", **kw)


def test_cuda_counters_are_ordered_and_never_added(ledger_path):
    from probes.runner import run_grid

    res = run_grid([cfg(micro_batch=4, precision="bf16")], ledger_path, progress=lambda m: None)
    df = read_lines(ledger_path)
    df = df[df.run_id == res.run_ids[0]]
    assert list(df["phase"]) == list(PHASES) and (df["verdict"] == "ok").all(), df[["phase", "detail"]]
    for r in df.itertuples():
        assert r.peak_reserved_bytes >= r.peak_allocated_bytes > 0, r.phase
        assert r.device_used_bytes >= r.peak_reserved_bytes, r.phase  # driver-level covers the pool
        assert r.context_bytes > 0 and r.num_ooms_delta == 0
        assert r.cuda_version and r.device_name


def test_cap_below_need_is_oom_and_next_config_starts_clean(ledger_path):
    from probes.runner import run_grid

    small, big = cfg(micro_batch=1), cfg(micro_batch=64, seq_len=1024, eval_seq_len=1024)
    res = run_grid([dataclasses.replace(big, cap="64MiB", cap_bytes=64 * 2**20), small],
                   ledger_path, progress=lambda m: None)
    df = read_lines(ledger_path)
    first, second = (df[df.run_id == r] for r in res.run_ids)
    assert "oom" in set(first["verdict"])
    assert (second["verdict"] == "ok").all()
    # a fresh process: the next configuration's setup starts from an empty allocator
    assert second[second.phase == "setup"]["baseline_allocated_bytes"].iloc[0] == 0


def test_estimated_memory_model_predicts_a_held_out_cuda_config(ledger_path):
    from planner.models.memory_model import build_model
    from probes.runner import run_grid

    grid = [cfg(micro_batch=mb, seq_len=s, eval_seq_len=s) for mb, s in [(1, 256), (2, 256), (1, 512), (4, 512)]]
    held = cfg(micro_batch=2, seq_len=512, eval_seq_len=512)
    run_grid(grid + [held], ledger_path, progress=lambda m: None)
    df = read_lines(ledger_path)
    model = build_model(df[df.config_key != held.key()], 1.15)
    actual = df[(df.config_key == held.key()) & (df.phase == "first_step")]["peak_reserved_bytes"].iloc[0]
    predicted = model.fits["first_step"].predict(2, 512)
    print(f"held-out first_step reserved: predicted {predicted / 2**20:.1f} MiB, measured {actual / 2**20:.1f} MiB")
    assert abs(predicted - actual) / actual < 0.10


def test_an_estimate_for_this_gpus_kernels_matches_its_measured_allocated_peak(tmp_path):
    """GPT-2-style attention dropout: the estimate runs flash / fused dropout / CUDA autocast as this GPU does."""
    import torch

    from planner.models.kernels import kernel_target
    from probes.runner import run_grid

    params = {"layers": 2, "d_model": 256, "heads": 4, "vocab": 8192, "dropout": 0.1}
    major, minor = torch.cuda.get_device_capability(0)
    target = kernel_target(f"{major}.{minor}")
    base = dict(params_json=json.dumps(params, sort_keys=True), micro_batch=8, seq_len=1024, eval_seq_len=1024,
                eval_micro_batch=8, precision="bf16")
    measured, estimated = str(tmp_path / "m.db"), str(tmp_path / "e.db")
    run_grid([ProbeConfig(device="cuda", **base)], measured, progress=lambda m: None)
    run_grid([ProbeConfig(mode="estimated", target=target, **base)], estimated, progress=lambda m: None)
    m, e = (read_lines(p).set_index("phase") for p in (measured, estimated))
    from planner.models.overheads import workspace_allocated_bytes

    ws = workspace_allocated_bytes(f"{major}.{minor}")  # cuBLAS keeps it from the first matmul on
    for phase in PHASES:
        extra = 0 if phase == "setup" else ws
        ratio = (e.loc[phase, "peak_allocated_bytes"] + extra) / m.loc[phase, "peak_allocated_bytes"]
        print(f"{phase}: estimated/measured allocated {ratio:.3f}; simulated/measured reserved "
              f"{e.loc[phase, 'simulated_reserved_bytes'] / m.loc[phase, 'peak_reserved_bytes']:.3f}")
        assert abs(ratio - 1) < 0.10, phase


def test_a_training_step_holds_two_sets_of_blas_workspaces():
    """The forward's matmuls run on this thread, the backward's on the autograd engine's device thread: each thread
    has its own cuBLAS handle, so its own workspace (planner/models/overheads.py). Counted on the real allocator."""
    import torch

    from planner.models.overheads import workspace_allocated_bytes

    major, minor = torch.cuda.get_device_capability(0)
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    x = torch.randn(64, 512, device="cuda")
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated()
    y = x @ w
    forward = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    y.sum().backward()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes() - w.grad.untyped_storage().nbytes()
    one = workspace_allocated_bytes(f"{major}.{minor}", threads=1)
    # cuBLASLt's 1 MiB comes only with the matmuls that take that path (a bias, some shapes): at most one per thread
    assert one - 2**20 <= forward <= one, forward
    assert 2 * (one - 2**20) <= held <= 2 * one, held


def test_the_cli_probe_runs_every_worker_on_the_gpu(tmp_path):
    """The probe as a user runs it, under the CUDA build: every worker the forkserver forks (the pilot's, resume's)
    builds the model on the GPU, none in a bad fork, and the lines carry the allocator's own counters."""
    from tests.conftest import TINY, WORKLOADS, builders, rentplan

    r = rentplan(tmp_path, "probe", "--device", "cuda", "--ledger", "l.db", "-w", f"{WORKLOADS}:fork_witness",
                 *[x for k, v in TINY.items() for x in ("-p", f"{k}={v}")], "--micro-batch", "2", "--seq-len", "64",
                 "--precision", "bf16")
    assert r.returncode == 0, r.stderr[-2000:]
    built = builders(tmp_path)
    assert len({pid for pid, _ in built}) >= 2 and not any(bad for _, bad in built), built
    df = read_lines(str(tmp_path / "l.db"))
    assert (df["verdict"] == "ok").all(), df[["phase", "verdict", "detail"]]
    assert df["device"].str.startswith("cuda").all() and (df["peak_reserved_bytes"] > 0).all()


def test_more_ranks_than_this_machines_gpus_is_an_error(tmp_path):
    import torch

    from tests.conftest import rentplan

    n = torch.cuda.device_count()
    r = rentplan(tmp_path, "probe", "--device", "cuda", "--strategy", "ddp", "--nproc", str(n + 1), "--ledger", "l.db",
                 "--micro-batch", "1", "--seq-len", "8")
    assert r.returncode == 1 and f"this machine has {n} CUDA device(s)" in r.stderr, r.stderr
    assert not (tmp_path / "l.db").exists()
