"""Estimates that check themselves (issue 26): a measured run and an estimate of the same configuration on the
same device are compared; past 3 % the sheet says so and the need widens by the measured ratio, never narrows.
Recurrent layers: oneDNN's training workspace (which the meta kernel leaves empty) is sized, and an LSTM's
estimate on this CPU lands within 5 % of its probe."""


import pandas as pd
import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.decisions.selfcheck import estimate_check
from planner.ledger import read_lines
from tests.factories import campaign_yaml, config, pilot_lines

MiB = 2**20
WORKLOADS = "tests/workloads.py"


def pair(measured_peak: int, estimated_peak: int) -> list:
    cfg = config(micro_batch=2, seq_len=128, eval_seq_len=128, eval_micro_batch=2, precision="fp32")
    m = pilot_lines(cfg, measured_peak)
    e = [ln.__class__(**{**ln.to_dict(), "run_id": "r-est", "mode": "estimated", "target": "cpu"})
         for ln in pilot_lines(cfg, estimated_peak)]
    return m + e


@pytest.mark.parametrize("measured, estimated, widens, says", [
    (110 * MiB, 100 * MiB, True, "short by 10.0%: the need is widened × 1.100"),
    (100 * MiB, 110 * MiB, False, "above it by 9.1%: the need is kept (never narrowed)"),
    (101 * MiB, 100 * MiB, False, "within 1.0%"),
])
def test_a_measured_and_an_estimated_run_of_one_shape_are_compared(measured, estimated, widens, says):
    from planner.ledger import lines_frame

    check = estimate_check(lines_frame(pair(measured, estimated)), "fp32")
    assert check.widens is widens and says in check.note
    assert "on Test CPU (micro-batch 2 × seq 128" in check.note


def test_no_pair_no_check():
    from planner.ledger import lines_frame

    lines = lines_frame(pilot_lines(config(precision="fp32"), 100 * MiB))
    assert estimate_check(lines, "fp32") is None


def rentplan(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


@pytest.mark.slow
def test_a_disagreement_found_by_the_pilot_widens_the_plans_need_and_shows_on_the_sheet(tmp_path, monkeypatch):
    """From the user's steps: probe and estimate the same configuration on this CPU, estimate for the GPU, plan.
    The workload allocates 8 MiB more when its tensors are real (as a kernel without a matching fake would)."""
    monkeypatch.chdir(tmp_path)
    w = ["-w", f"{WORKLOADS.replace('tests/', str(__import__('pathlib').Path(__file__).parent) + '/')}:hidden_scratch",
         "-p", "layers=1", "-p", "d_model=64", "-p", "heads=2", "-p", "vocab=256"]
    shape = ["--micro-batch", "2", "--seq-len", "64", "--eval-seq-len", "64", "--precision", "fp32"]
    rentplan("estimate", *w, *shape, "--target", "sm80+", "--ledger", "gpu-only.db")
    rentplan("estimate", *w, *shape, "--target", "sm80+", "--ledger", "l.db")
    rentplan("probe", *w, *shape, "--ledger", "l.db")
    rentplan("estimate", *w, *shape, "--target", "cpu", "--ledger", "l.db")
    lines = read_lines("l.db")
    check = estimate_check(lines, "fp32")
    assert check is not None and check.widens, check
    spec = campaign_yaml(workload=w[1], params={"layers": 1, "d_model": 64, "heads": 2, "vocab": 256},
                         precision="fp32", seq_len=64, effective_batch=2,
                         eval={"every_updates": 50, "examples": 8, "seq_len": 64})
    (tmp_path / "c.yaml").write_text(spec)
    needs = {}
    for ledger in ("gpu-only.db", "l.db"):
        rentplan("plan", "--campaign", "c.yaml", "--ledger", ledger, "--out", ledger + "-out",
                 "--offer", "vast-rtx_4090-1x")
        row = pd.read_csv(tmp_path / f"{ledger}-out" / "selection.csv").set_index("offer").loc["vast-rtx_4090-1x"]
        needs[ledger] = row["need_bytes"]
        notes = row["notes"] if isinstance(row["notes"], str) else ""
    assert needs["l.db"] == pytest.approx(needs["gpu-only.db"] * check.ratio, rel=1e-6)
    assert "short by" in notes and "the need is widened" in notes
    assert "short by" in (tmp_path / "l.db-out" / "order_sheet.md").read_text()


def test_the_lstm_workspace_is_sized_as_the_real_kernel_gives_it():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from probes.fake import RNN_LAYER, rnn_workspace_bytes

    seen = {}

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is RNN_LAYER:
                seen.setdefault("args", args)
                seen.setdefault("real", out[3].numel() * out[3].element_size())
            return out

    for steps, batch, width in ((256, 8, 256), (100, 3, 50), (40, 16, 300)):
        seen.clear()
        lstm = torch.nn.LSTM(width, width, batch_first=True)
        with Spy():
            lstm(torch.randn(batch, steps, width, requires_grad=True))
        with FakeTensorMode(allow_non_fake_inputs=True) as m:  # the same call's arguments as fake tensors
            fake_args = [m.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in seen["args"]]
        assert rnn_workspace_bytes(*fake_args) == pytest.approx(seen["real"], rel=0.01), (steps, batch, width)


@pytest.mark.slow
def test_an_lstm_estimate_on_this_cpu_is_within_5_percent_of_its_probe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from pathlib import Path

    w = ["-w", f"{Path(__file__).parent / 'workloads.py'}:lstm_lm"]
    shape = ["--micro-batch", "8", "--seq-len", "128", "--eval-seq-len", "128", "--precision", "fp32"]
    rentplan("probe", *w, *shape, "--ledger", "l.db")
    rentplan("estimate", *w, *shape, "--target", "cpu", "--ledger", "l.db")
    lines = read_lines("l.db")
    peak = lines.groupby(["mode", "phase"])["peak_allocated_bytes"].max()
    for phase in ("first_step", "steady", "eval", "resume"):
        assert peak["estimated", phase] == pytest.approx(peak["measured", phase], rel=0.05), phase
    steady = lines[(lines["mode"] == "estimated") & (lines["phase"] == "steady")].iloc[0]
    assert "oneDNN's training workspace queried from the real kernel" in steady["detail"]
    check = estimate_check(lines, "fp32")
    assert check is not None and not check.widens
