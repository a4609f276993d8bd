"""An estimate counts steady's forward and backward passes by replaying first_step's record, and resume's update
by replaying steady's (probes/pilot.py, Pilot.first_update, recorded_update, replayed_update) instead of tracing
them. Every line must read exactly as when it is traced: the grid as a user runs it against the same configurations
traced, and single estimates of every kind the replay takes, figure by figure; what it cannot prove the same is
traced."""

import dataclasses
import json

import pytest

from planner.records import PHASES, ProbeConfig

torch = pytest.importorskip("torch")
from probes.memory import LiveTensorTracker  # noqa: E402
from probes.pilot import Pilot  # noqa: E402

SMALL = {"layers": 2, "d_model": 64, "heads": 4, "vocab": 128}
# what a line says that is not the estimate: when, how long, which run
NOT_FIGURES = {"seconds", "started_at", "run_id", "probe_id", "id", "host", "seq"}


def figures(line) -> dict:
    d = line if isinstance(line, dict) else dataclasses.asdict(line)
    return {k: v for k, v in d.items() if k not in NOT_FIGURES}


def pilot(tmp_path, cfg: ProbeConfig, replay: bool) -> tuple[dict, Pilot]:
    lines: dict = {}
    p = Pilot(cfg, str(tmp_path), lambda k, x: lines.__setitem__(x["phase"], x) if k == "line" else None, "r", "p")
    p.replay_updates = replay
    p.run(PHASES)
    return lines, p


def config(params=SMALL, **kw) -> ProbeConfig:
    base = dict(params_json=json.dumps(params, sort_keys=True), micro_batch=2, seq_len=32, eval_seq_len=64,
                precision="bf16", mode="estimated", target="sm80+")
    return ProbeConfig(**{**base, **kw})


CASES = [
    pytest.param({}, id="gpt-sm80"),
    pytest.param(dict(params_json=json.dumps({**SMALL, "dropout": 0.1}), grad_accum=3, checkpointing=True,
                      optimizer="adafactor"), marks=pytest.mark.slow, id="gpt-accum3-ckpt-dropout-adafactor"),
    pytest.param(dict(precision="fp32", target="cpu", optimizer="sgd"), marks=pytest.mark.slow, id="gpt-cpu-sgd"),
    pytest.param(dict(precision="bf16-true", target="sm50-75", optimizer="adamw_fused"), marks=pytest.mark.slow,
                 id="gpt-bf16true-fused"),
    pytest.param(dict(workload="builtin:classifier", params_json=json.dumps({"layers": 2, "d_model": 32}),
                      micro_batch=3, grad_accum=2, precision="fp16", target="sm50-75"), marks=pytest.mark.slow,
                 id="classifier-fp16"),
    pytest.param(dict(micro_batch=1, seq_len=48, eval_micro_batch=2, eval_seq_len=16, steady_updates=5),
                 marks=pytest.mark.slow, id="gpt-eval-shorter"),
]


@pytest.mark.parametrize("kw", CASES)
def test_a_replayed_resume_reads_as_a_traced_one(tmp_path, kw):
    pytest.importorskip("transformers")  # a process that imported model code: a builtin's line names none (a
    # slow run's grid test read 'transformers 5.25.0, ...' in process against '' from its workers)
    cfg = config(**kw)
    traced, old = pilot(tmp_path, cfg, replay=False)
    replayed, new = pilot(tmp_path, cfg, replay=True)
    # both replays were taken, and only where asked
    assert (old.replayed_micro, old.replayed, new.replayed_micro, new.replayed) == (False, False, True, True)
    assert list(replayed) == list(PHASES)
    for phase in PHASES:
        assert replayed[phase]["verdict"] == "ok", replayed[phase]["detail"]
        assert figures(replayed[phase]) == figures(traced[phase]), phase
        assert replayed[phase]["libraries"] == "", phase


@pytest.mark.slow  # three estimates
def test_what_the_replay_cannot_prove_the_same_is_traced(tmp_path):
    """A cap (an OOM mid-update has its own message), a workload not built in (its code may keep state between
    updates) and an optimizer outside torch's are traced; so is an update whose batches differ from the
    recorded one's, and the lines are what tracing gives."""
    from tests.conftest import WORKLOADS

    for cfg in (config(cap_bytes=1 << 40, cap="1 TiB"),
                config(workload=f"{WORKLOADS}:conv_audio", params_json="{}", precision="fp32", target="cpu")):
        lines, p = pilot(tmp_path, cfg, replay=True)
        assert not p.replayed and not p.replayed_micro and all(ln["verdict"] == "ok" for ln in lines.values())



@pytest.mark.slow  # two estimates, 5.6 s
def test_batches_of_another_shape_are_traced(tmp_path):
    """Later batches longer than the first (a workload whose batch length varies with its index): steady's
    forward and backward cannot be first_step's, so they are traced; resume's batch is as long as steady's, so its
    update is replayed. Every figure as when all is traced."""
    from probes.builtin import GPT

    def ragged(split, index, micro_batch, seq_len):
        return GPT.make_batch(p.workload, split, index, micro_batch, seq_len + 8 * (index > 0))

    runs = []
    for replay in (False, True):
        seen: dict = {}
        p = Pilot(config(), str(tmp_path), lambda k, x, seen=seen: seen.__setitem__(x["phase"], x) if k == "line"
                  else None, "r", "p")
        p.workload.make_batch = ragged
        p.replay_updates = replay
        p.run(PHASES)
        runs.append((seen, p))
    (traced, _), (lines, p) = runs
    assert (p.replayed_micro, p.replayed) == (False, True)
    for phase in PHASES:
        assert lines[phase]["verdict"] == "ok" and figures(lines[phase]) == figures(traced[phase]), phase


def test_a_recording_replays_what_the_tracker_counted():
    """The tracker's record of a block, replayed on another tracker from another state, moves its counters and
    its allocator model exactly as running the block there does."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from probes.pilot import cuda_allocator_model

    def block(held):
        a = torch.empty(1000)
        b = torch.empty(300, 7)
        del a
        c = (b @ b.t()).sum(0)
        held.append(c)
        del b
        return c

    with FakeTensorMode():
        def tracker_with(n):
            t = LiveTensorTracker(allocator=cuda_allocator_model())
            with t:
                kept = [torch.empty(n), torch.empty(3 * n)]
                del kept[0]
            return t, kept

        first, _ = tracker_with(5000)
        with first:
            with first.record() as rec:
                block([])
        assert rec.replayable and sum(1 for ev in rec.events if ev is None) >= 3
        ran, keep1 = tracker_with(70000)
        with ran:
            block([])
        replayed, keep2 = tracker_with(70000)
        replayed.replay(rec)
    def counters(t):
        a = t.allocator
        return t.live, t.peak, a.allocated, a.peak_allocated, a.reserved, a.peak_reserved

    assert counters(ran) == counters(replayed) and counters(ran) != counters(first)


@pytest.mark.slow  # the grid through forked workers, side by side: more than a few seconds
def test_the_grid_reads_as_when_every_update_is_traced(tmp_path):
    """The grid as `rentplan estimate` runs it (workers side by side, replay on) against the same configurations
    each traced whole in this process (replay off): every line, every figure."""
    from probes.runner import run_grid

    configs = [config(micro_batch=mb, seq_len=seq) for mb in (1, 2, 4) for seq in (32, 64)]
    result = run_grid(configs, tmp_path / "l.db", progress=lambda m: None, jobs=2)
    got = {(ln.config_key, ln.phase): figures(ln) for ln in result.lines}
    assert len(got) == len(configs) * len(PHASES)
    for cfg in configs:
        traced, _ = pilot(tmp_path, cfg, replay=False)
        for phase in PHASES:
            assert got[cfg.key(), phase] == figures(traced[phase]), (cfg.label(), phase)


@pytest.mark.slow  # two estimates, 6 s
def test_a_workload_file_returning_a_built_in_model_is_traced(tmp_path):
    """A reviewer's attack (#43 item 7): a workload file returning `GPT(**kw)` with its own compute_loss (a z-loss
    that runs a second forward after the first micro-step) passed the guard (its type is the built-in's), so steady
    and resume were replayed from first_step's record: steady's peak 7,573,620 bytes and half the FLOPs, where
    tracing gives 8,172,672. Only a `builtin:` reference is replayed: code the user wrote is traced."""
    (tmp_path / "mywl.py").write_text(
        "from probes.builtin import GPT\n\n"
        "def warmup(**kw):\n"
        "    w = GPT(**kw)\n"
        "    inner, calls = w.compute_loss, [0]\n\n"
        "    def compute_loss(model, batch):\n"
        "        calls[0] += 1\n"
        "        loss = inner(model, batch)\n"
        "        if calls[0] > 1:  # after the first micro-step: an auxiliary z-loss, a second forward\n"
        "            loss = loss + 1e-4 * model(batch['input_ids']).float().logsumexp(-1).pow(2).mean()\n"
        "        return loss\n\n"
        "    w.compute_loss = compute_loss\n"
        "    return w\n")
    cfg = config(workload=f"{tmp_path / 'mywl.py'}:warmup")
    traced, _ = pilot(tmp_path, cfg, replay=False)
    lines, p = pilot(tmp_path, cfg, replay=True)
    assert not p.replayed and not p.replayed_micro
    for phase in PHASES:
        assert figures(lines[phase]) == figures(traced[phase]), phase
