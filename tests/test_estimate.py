"""Estimates under fake tensors agree with measurement; the memory model predicts; the search brackets."""

import json
import os
import subprocess
import sys

import pytest

from planner.inputs.grid import GridSpec
from planner.ledger import read_lines
from planner.models.memory_model import build_model
from planner.records import PHASES, ProbeConfig
from tests.conftest import ROOT, WORKLOADS

pytest.importorskip("torch")
from probes.pilot import TRAIN_WORKER_PHASES, Pilot  # noqa: E402

SMALL = {"layers": 2, "d_model": 64, "heads": 2, "vocab": 128}


def pilot_lines(tmp_path, mode, ref="builtin:gpt", params=SMALL, **kw):
    cfg = ProbeConfig(workload=ref, params_json=json.dumps(params, sort_keys=True), mode=mode, **kw)
    lines = {}
    # as the runner does: a measured resume in a fresh worker, an estimate's in the same one
    for phases in ((TRAIN_WORKER_PHASES, ("resume",)) if mode == "measured" else (PHASES,)):
        Pilot(cfg, str(tmp_path), lambda k, x: lines.__setitem__(x["phase"], x) if k == "line" else None,
              f"r-{mode}", "p").run(phases)
    return lines


@pytest.mark.parametrize("ref", ["builtin:gpt", "builtin:classifier"])
@pytest.mark.parametrize("size", [dict(micro_batch=1, seq_len=32, eval_seq_len=64),
                                  dict(micro_batch=4, seq_len=128, eval_seq_len=256, precision="bf16")])
@pytest.mark.slow
def test_estimate_matches_measured_allocated_peak_per_phase(tmp_path, ref, size):
    measured = pilot_lines(tmp_path, "measured", ref, **size)
    estimated = pilot_lines(tmp_path, "estimated", ref, **size)
    for phase in PHASES:
        m, e = measured[phase], estimated[phase]
        assert m["verdict"] == e["verdict"] == "ok", (phase, e["detail"])
        assert e["mode"] == "estimated" and e["peak_reserved_bytes"] is None and e["device_used_bytes"] is None
        assert abs(e["peak_allocated_bytes"] - m["peak_allocated_bytes"]) <= 0.01 * m["peak_allocated_bytes"], phase
    # A CPU pilot's census counts each GPU target's kernels; a CPU-kernel estimate counts the CPU's, whose fused
    # attention (_scaled_dot_product_flash_attention_for_cpu) has no FLOP formula in torch.utils.flop_counter.
    census = json.loads(measured["steady"]["op_profile_json"])
    assert set(census) == {"sm80+", "sm50-75"}
    assert census["sm80+"]["flops"] == measured["steady"]["flops_per_update"] >= estimated["steady"]["flops_per_update"]


@pytest.mark.slow
def test_memory_model_predicts_held_out_measured_configs_within_3_percent(tmp_path):
    from planner.ledger import Ledger
    from planner.records import Line

    # One point where the optimizer step sets the peak, three where activations do (the regimes a real grid spans)
    fit_on = [(1, 64), (4, 256), (8, 128), (8, 256)]
    held_out = [(2, 64), (6, 256), (8, 192), (6, 192), (5, 224)]
    db = str(tmp_path / "l.db")
    with Ledger(db) as led:
        for mb, seq in fit_on + held_out:
            for line in pilot_lines(tmp_path, "measured", micro_batch=mb, seq_len=seq, eval_seq_len=seq,
                                    eval_micro_batch=mb).values():
                led.append(Line(**{**line, "run_id": f"r{mb}-{seq}"}))
    df = read_lines(db)
    # The fit itself, on allocated bytes (the simulated reserved of a model this small moves in 2 MiB segments)
    df["simulated_reserved_bytes"] = None
    fit_df = df[df["run_id"].isin([f"r{mb}-{s}" for mb, s in fit_on])]
    model = build_model(fit_df, 1.0)
    for mb, seq in held_out:
        rows = df[df["run_id"] == f"r{mb}-{seq}"].set_index("phase")
        for phase in ("first_step", "steady", "eval"):
            actual = rows.loc[phase, "peak_allocated_bytes"]
            predicted = model.fits[phase].predict(mb, seq)
            assert abs(predicted - actual) / actual < 0.03, (mb, seq, phase, predicted, actual)


@pytest.mark.slow
def test_search_brackets_the_largest_size_under_a_cap_and_reports_only_tested(tmp_path):
    from probes.search import find_max

    # The cap's rule is CUDA's: the caching allocator (modelled, the cap as its limit, cached blocks released
    # before it gives up) must find room. Unlimited, micro-batch 9 reserves 32 MiB (a 20 MiB segment for its
    # first request past 1 MiB); under a limit of 21 MiB it releases and runs on, as a GPU would.
    cap = 21 * 2**20
    spec = GridSpec(params=SMALL, micro_batch=[1], seq_len=[64], cap="21MiB", cap_bytes=cap)
    res = find_max(spec, "max-micro-batch", str(tmp_path / "s.db"), progress=lambda m: None)
    assert res.best and res.failed_above == res.best + 1
    assert (res.best, "ok") in res.tried and (res.best + 1, "oom") in res.tried  # the answer was run, not predicted
    for mb, verdict in ((res.best, "ok"), (res.best + 1, "oom")):  # and direct runs under the cap agree
        lines = pilot_lines(tmp_path, "measured", micro_batch=mb, seq_len=64, eval_seq_len=64, eval_micro_batch=mb,
                            cap="21MiB", cap_bytes=cap)
        verdicts = {x["verdict"] for x in lines.values()}
        assert verdicts == {"ok"} if verdict == "ok" else "oom" in verdicts, (mb, verdicts)
    assert res.real_probes <= 4
    # The same search again on the same ledger: every size it tries has finished there, so nothing reruns, and the
    # earlier runs' lines decide each step as they did the first time.
    said = []
    again = find_max(spec, "max-micro-batch", str(tmp_path / "s.db"), progress=said.append)
    assert (again.best, again.failed_above, again.tried) == (res.best, res.failed_above, res.tried)
    assert sum(m.startswith("skip") for m in said) >= again.estimate_probes, said  # finished estimates: not rerun


@pytest.mark.slow
def test_seven_billion_estimate_never_allocates_the_model(tmp_path):
    code = f"""
import json, resource, sys
sys.path.insert(0, {str(ROOT)!r})
from planner.records import ProbeConfig
from probes.pilot import Pilot
cfg = ProbeConfig(params_json=json.dumps({{"layers": 32, "d_model": 4096, "ffn": 11008, "heads": 32,
                  "vocab": 32000}}), micro_batch=1, seq_len=2048, eval_seq_len=2048, precision="bf16",
                  mode="estimated")
out = {{}}
Pilot(cfg, {str(tmp_path)!r}, lambda k, x: out.__setitem__(x["phase"], x) if k == "line" else None,
      "r", "p").run(("setup", "first_step"))
print(json.dumps({{"rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "peak": out["first_step"]["peak_allocated_bytes"], "params": out["setup"]["param_count"],
                  "verdict": out["first_step"]["verdict"]}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["verdict"] == "ok" and res["params"] > 5e9
    model_bytes = res["params"] * 4
    assert res["peak"] > 4 * model_bytes  # weights + grads + AdamW state (+ activations), all fake
    assert res["rss"] < 2 * 2**30 < model_bytes / 8  # the process never held even a fraction of it


@pytest.mark.parametrize("ref, params, ckpt", [
    ("builtin:gpt", SMALL, True),
    (f"{WORKLOADS}:conv_audio", {}, True),
])
@pytest.mark.slow
def test_an_estimates_census_leaves_every_peak_unchanged(tmp_path, monkeypatch, ref, params, ckpt):
    """The op census rides on an estimate's steady update: every figure of every phase must be what it is with
    a pass-through mode in its place (FlopCounterMode once kept checkpointed recomputations alive)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    import probes.pilot

    def run():
        return pilot_lines(tmp_path, "estimated", ref, params, micro_batch=4, seq_len=512, eval_seq_len=512,
                           checkpointing=ckpt)

    with_census = run()
    assert with_census["steady"]["flops_per_update"] > 0

    class PassThrough(TorchDispatchMode):
        rows: Counter = Counter()  # what the pilot reads of a census besides its profile (replayed micro-steps)
        launches = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

        def profile(self):
            return {"ops": [], "launches": 0, "flops": 0, "bytes": 0}

    monkeypatch.setattr(probes.pilot, "OpCensus", PassThrough)
    without = run()
    for phase in PHASES:
        for field in ("peak_allocated_bytes", "simulated_reserved_bytes", "baseline_allocated_bytes"):
            assert with_census[phase][field] == without[phase][field], (phase, field)


@pytest.mark.parametrize("fake", [False, True])
def test_gradient_clipping_takes_the_foreach_kernels_a_real_run_takes(fake):
    """Real tensors clip with _foreach_norm/_foreach_mul_ (CUDA and CPU alike); fake ones fail torch's type check
    and would fall back to a norm and a multiply per parameter, ops no real run dispatches."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from probes.loop import Trainer
    from probes.workloads import load_workload

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cfg = ProbeConfig(params_json=json.dumps(SMALL, sort_keys=True), micro_batch=2, seq_len=16, eval_seq_len=16)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        trainer = Trainer(load_workload(cfg.workload, json.loads(cfg.params_json)), cfg, torch.device("cpu"), fake=fake)
        trainer.begin_window(list(range(cfg.grad_accum)))
        trainer.micro_step()
        names = Names()
        with names:
            trainer.finish_window()
    n_params = len(list(trainer.model.parameters()))
    assert names.seen.count("_foreach_norm") == 1 and names.seen.count("_foreach_mul_") >= 1
    assert names.seen.count("linalg_vector_norm") == 1 < n_params  # only the norm of the stacked norms


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_device_queries_answered_without_fake_tensor_mode_change_no_figure(tmp_path, monkeypatch):
    """The tracker and the census answer `.device` of a fake tensor themselves (three in four ops an estimate
    dispatches). Every figure of every phase, the census included, must be what the full dispatch gives."""
    import probes.census
    import probes.memory

    def run():
        return pilot_lines(tmp_path, "estimated", params={**SMALL, "dropout": 0.1}, micro_batch=2, seq_len=64,
                           eval_seq_len=128, precision="bf16", target="sm80+")

    fast = run()
    monkeypatch.setattr(probes.memory, "_DEVICE", object())  # the short cut never matches
    monkeypatch.setattr(probes.census, "_DEVICE", object())
    full = run()
    for phase in PHASES:
        assert fast[phase]["verdict"] == full[phase]["verdict"] == "ok", fast[phase]["detail"]
        for field in ("peak_allocated_bytes", "simulated_reserved_bytes", "baseline_allocated_bytes",
                      "flops_per_update", "ops_per_update", "op_profile_json"):
            assert fast[phase][field] == full[phase][field], (phase, field)


FIRST_AND_SECOND = """
import json, sys, tempfile
from tests.test_estimate import SMALL, pilot_lines
runs = [pilot_lines(tempfile.mkdtemp(), "estimated", params=SMALL, micro_batch=2, seq_len=64, eval_seq_len=128,
                    target="sm80+") for _ in range(2)]
print(json.dumps([{p: ln["peak_allocated_bytes"] for p, ln in r.items()} for r in runs]))
"""


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_a_process_first_estimate_reads_what_its_second_does():
    """An estimate depends only on its workload: the first one in a fresh process (nothing imported lazily yet)
    gives every phase the peak the next one gives (the first export once counted what importing peft made)."""
    r = subprocess.run([sys.executable, "-c", FIRST_AND_SECOND], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-2000:]
    first, second = json.loads(r.stdout.strip().splitlines()[-1])
    assert first == second


@pytest.mark.slow  # a process's estimate: more than a few seconds
def test_estimate_says_the_kernels_it_estimates_for(tmp_path):
    """User (#44): `estimate --target sm80+` printed "probe: 1 configuration(s) × 7 phases on cpu", as if it
    measured on this CPU: it names the kernel basis it estimates for, and says the CPU only hosts fake tensors."""
    from click.testing import CliRunner

    from planner.cli import cli

    r = CliRunner().invoke(cli, ["estimate", *[x for k, v in SMALL.items() for x in ("-p", f"{k}={v}")],
                                 "--seq-len", "32", "--precision", "bf16", "--target", "sm80+", "--ledger",
                                 str(tmp_path / "l.db"), "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "on cpu" not in r.stderr
    assert "estimate: 1 configuration(s) × 7 phases for the kernels of sm80+" in r.stderr
    assert "under fake tensors on this machine's CPU (no memory touched)" in r.stderr
