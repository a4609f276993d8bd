"""rentplan verify: refuse an order whose device is absent; adopt an order made from this machine's pilot."""

import json
import re

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import read_lines
from tests.conftest import TINY, has_cuda
from tests.factories import campaign_yaml, standard_ledger

pytest.importorskip("torch")


def test_cuda_order_on_a_cpu_machine_is_not_adopted(tmp_path):
    if has_cuda():
        pytest.skip("this machine has CUDA")
    ledger = standard_ledger(tmp_path / "l.db")
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml())
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(out),
                                 "--offer", "aws-h100_sxm-8x"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["verify", str(out / "order.json")])
    assert r.exit_code == 1
    assert "do not adopt" in r.output and "no CUDA device found" in r.output and "H100" in r.output


@pytest.mark.slow
def test_order_from_this_machines_cpu_pilot_is_adopted(tmp_path):
    runner = CliRunner()
    ledger = str(tmp_path / "l.db")
    args = ["probe", "--ledger", ledger, "--device", "cpu", "--micro-batch", "1,2", "--seq-len", "32",
            "--precision", "bf16"] + [x for k, v in TINY.items() for x in ("-p", f"{k}={v}")]
    r = runner.invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml(params=TINY, seq_len=32, eval={"every_updates": 50, "examples": 8, "seq_len": 32}))
    out = tmp_path / "out"
    r = runner.invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(out),
                            "--offer", "local"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    order = json.loads((out / "order.json").read_text())
    assert order["expect"]["device_kind"] == "cpu"
    checked = str(tmp_path / "verify.db")
    r = runner.invoke(cli, ["verify", str(out / "order.json"), "--ledger", checked], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "adopt: every check passed" in r.output
    assert "[ok  ] peak memory" in r.output and "[ok  ] pilot: all phases ok" in r.output
    # The pilot's need follows the plan's rule: its lines carry the allocator model's reserved peak, so that is
    # the need (not allocated × the flat factor, a rule the plan uses only for lines without one).
    lines = read_lines(checked)
    assert lines["simulated_reserved_bytes"].notna().all()
    said = re.search(r"pilot needs ([0-9.]+) GiB", r.output).group(1)
    assert said == f"{lines['simulated_reserved_bytes'].max() / 2**30:.3f}"
    # Verified again with the same ledger: the finished pilot is not rerun, and its lines still decide.
    again = runner.invoke(cli, ["verify", str(out / "order.json"), "--ledger", checked], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert f"pilot needs {said} GiB" in again.output and "[ok  ] pilot: all phases ok" in again.output
    assert len(read_lines(checked)) == len(lines)
