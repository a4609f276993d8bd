"""What the CPU tracker measures, phase by phase, run in-process through the same Pilot the workers use."""

import json

import pytest

from planner.records import ProbeConfig
from tests.conftest import TINY

torch = pytest.importorskip("torch")
from probes.pilot import TRAIN_WORKER_PHASES, Pilot  # noqa: E402


def run_pilot(tmp_path, phases=TRAIN_WORKER_PHASES, **cfg_kw):
    params = cfg_kw.pop("params", TINY)
    cfg = ProbeConfig(params_json=json.dumps(params, sort_keys=True), **cfg_kw)
    lines = {}
    pilot = Pilot(cfg, str(tmp_path), lambda kind, x: lines.__setitem__(x["phase"], x) if kind == "line" else None,
                  "r-test", "p-test")
    pilot.run(phases)
    return lines, pilot


@pytest.mark.slow
def test_adamw_state_counted_to_the_byte(tmp_path):
    lines, pilot = run_pilot(tmp_path, optimizer="adamw", micro_batch=2, seq_len=16, eval_seq_len=16)
    params = list(pilot.trainer.model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    step_bytes = 4 * len(params)  # one float32 step counter per parameter tensor
    state = lines["first_step"]["optimizer_state_bytes"]
    assert state == 2 * param_bytes + step_bytes
    # live bytes after the first update (grads set to None) minus after setup = the optimizer state
    grown = lines["steady"]["baseline_allocated_bytes"] - lines["first_step"]["baseline_allocated_bytes"]
    assert grown == state
    # first_step peak holds at least weights + gradients + state at once
    assert lines["first_step"]["peak_allocated_bytes"] >= 2 * param_bytes + state
    assert lines["setup"]["peak_allocated_bytes"] >= param_bytes


@pytest.mark.slow
def test_sgd_without_momentum_keeps_no_state(tmp_path):
    lines, _ = run_pilot(tmp_path, optimizer="sgd", micro_batch=2, seq_len=16, eval_seq_len=16)
    assert lines["first_step"]["optimizer_state_bytes"] == 0
    assert lines["steady"]["baseline_allocated_bytes"] == lines["first_step"]["baseline_allocated_bytes"]


@pytest.mark.slow
def test_cpu_lines_have_no_reserved_and_all_phases_ok(tmp_path):
    lines, _ = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=32)
    for phase, line in lines.items():
        assert line["verdict"] == "ok", (phase, line["detail"])
        assert line["peak_reserved_bytes"] is None  # CPU has no reserved pool: never invented
        assert line["peak_allocated_bytes"] > 0
        assert line["device_used_bytes"] >= line["peak_allocated_bytes"]  # RSS covers the tensors
        assert line["mode"] == "measured" and line["device"] == "cpu" and line["torch_version"]
    times = json.loads(lines["steady"]["update_times_s"])
    assert len(times) == 3 and lines["steady"]["update_s"] == sorted(times)[1]
    assert lines["steady"]["flops_per_update"] > 0 and lines["steady"]["ops_per_update"] > 0  # the census pass


def peak(tmp_path, phase="first_step", **kw):
    lines, _ = run_pilot(tmp_path, **kw)
    return lines[phase]["peak_allocated_bytes"]


@pytest.mark.slow
def test_allocated_grows_with_micro_batch_and_sequence_length(tmp_path):
    params = {"layers": 2, "d_model": 64, "heads": 2, "vocab": 128}
    base = peak(tmp_path, params=params, micro_batch=1, seq_len=128)
    assert peak(tmp_path, params=params, micro_batch=4, seq_len=128) > base
    assert peak(tmp_path, params=params, micro_batch=1, seq_len=512) > base


@pytest.mark.slow
def test_eval_at_twice_the_length_has_its_own_peak(tmp_path):
    params = {"layers": 2, "d_model": 64, "heads": 2, "vocab": 128}
    short = peak(tmp_path, "eval", params=params, micro_batch=2, seq_len=128, eval_seq_len=128, eval_micro_batch=2)
    long = peak(tmp_path, "eval", params=params, micro_batch=2, seq_len=128, eval_seq_len=256, eval_micro_batch=2)
    assert long > short


@pytest.mark.slow
def test_activation_checkpointing_lowers_first_step_peak(tmp_path):
    params = {"layers": 4, "d_model": 128, "heads": 4, "vocab": 256}
    plain = peak(tmp_path, params=params, micro_batch=2, seq_len=512, checkpointing=False)
    ckpt = peak(tmp_path, params=params, micro_batch=2, seq_len=512, checkpointing=True)
    assert ckpt < plain


@pytest.mark.slow
def test_bf16_and_fp16_on_cpu(tmp_path):
    lines, pilot = run_pilot(tmp_path, precision="bf16", micro_batch=1, seq_len=16, eval_seq_len=16)
    assert all(line["verdict"] == "ok" for line in lines.values())
    assert lines["steady"]["precision"] == "bf16" and pilot.trainer.scaler is None
    lines, pilot = run_pilot(tmp_path, precision="fp16", micro_batch=1, seq_len=16, eval_seq_len=16)
    assert all(line["verdict"] == "ok" for line in lines.values())
    assert pilot.trainer.scaler is not None  # fp16 needs a gradient scaler


def test_cap_below_need_is_oom_not_crash(tmp_path):
    lines, _ = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=16, cap="tiny", cap_bytes=200_000)
    verdicts = {p: line["verdict"] for p, line in lines.items()}
    assert "oom" in verdicts.values()
    assert "CPU cap exceeded" in next(line["detail"] for line in lines.values() if line["verdict"] == "oom")


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_cap_follows_cudas_caching_allocator_not_the_allocated_bytes(tmp_path):
    """`rentplan probe --cap SIZE` on a CPU: a cap above the run's allocated peak but below what CUDA's caching
    allocator would reserve for the same allocations is an OOM, as set_per_process_memory_fraction makes it on
    a GPU (a segment that would pass the limit fails once cached blocks are released). Counting allocated bytes
    called it a fit."""
    free, _ = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=16)
    allocated = max(line["peak_allocated_bytes"] for line in free.values())
    reserved = max(line["simulated_reserved_bytes"] for line in free.values())
    assert reserved > allocated
    cap = (allocated + reserved) // 2
    capped, _ = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=16, cap="between", cap_bytes=cap)
    oom = [line for line in capped.values() if line["verdict"] == "oom"]
    assert oom and "caching allocator" in oom[0]["detail"], {p: x["verdict"] for p, x in capped.items()}
    roomy, _ = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=16, cap="reserved", cap_bytes=reserved)
    assert all(line["verdict"] == "ok" for line in roomy.values())


@pytest.mark.slow
def test_cap_above_need_is_ok(tmp_path):
    lines, _ = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=16, cap="1GiB", cap_bytes=2**30)
    assert all(line["verdict"] == "ok" for line in lines.values())


@pytest.mark.slow
def test_resume_loads_weights_only_and_continues(tmp_path):
    lines, pilot = run_pilot(tmp_path, micro_batch=1, seq_len=16, eval_seq_len=16)
    lines2, pilot2 = run_pilot(tmp_path, phases=("resume",), micro_batch=1, seq_len=16, eval_seq_len=16)
    assert lines2["resume"]["verdict"] == "ok", lines2["resume"]["detail"]
    assert pilot2.trainer.update == 5  # first + 3 steady + the resumed one
    state = torch.load(pilot.ckpt_path, weights_only=True)  # no allowlist needed
    assert set(state) >= {"model", "optimizer", "scheduler", "rng", "update", "position"}
