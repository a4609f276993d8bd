"""Claims that cannot go stale (issue 28): a claim stands only while its heartbeat is fresh, whatever process now
holds its pid; campaign runs claim each (variant, seed) as probes claim configurations."""

import os
import time

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import Ledger
from tests.factories import campaign_yaml


def test_a_stale_claim_is_taken_over_even_when_its_pid_is_alive_now(tmp_path):
    """User: a probe killed three days ago left its claim; its pid now belongs to another live process."""
    with Ledger(tmp_path / "l.db") as led:
        led.claim("cfg", "r-old", pid=os.getpid())  # this very process: alive
        led.db.execute("UPDATE claims SET heartbeat = ?", (time.time() - 3 * 86400,))
        led.db.commit()
        assert led.claim("cfg", "r-new") is None  # taken over
        fresh = led.claim("cfg", "r-third")
        assert fresh is not None and fresh["run_id"] == "r-new"  # a fresh claim of a live process stands


SPEC = campaign_yaml(
    name="claims", params={"layers": 1, "d_model": 32, "heads": 2, "vocab": 64}, seq_len=16, effective_batch=4,
    updates=2,
    eval={"every_updates": 1, "examples": 4, "seq_len": 16}, precision="fp32", setup_hours=None,
    variants=[{"id": "a", "lr": 0.01}, {"id": "b", "lr": 0.02}])


@pytest.mark.slow
def test_a_second_campaign_run_skips_what_the_first_is_training_or_finished(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(SPEC)
    with Ledger(tmp_path / "l.db") as led:  # another command is training variant a right now
        assert led.claim("campaign:claims:a:0", "k-other") is None
    r = CliRunner().invoke(cli, ["campaign", "run", "c.yaml", "--ledger", "l.db"])
    assert r.exit_code == 0, r.output
    assert "skip a seed 0: another campaign run is training it now" in r.output
    assert "1 run: 1 finished" in r.output and "1 left to another campaign run" in r.output
    with Ledger(tmp_path / "l.db") as led:
        runs = led.table("campaign_runs")
        assert list(runs["variant"]) == ["b"]
        assert led.db.execute("SELECT COUNT(*) FROM claims WHERE config_key LIKE 'campaign:%b%'").fetchone()[0] == 0


FORKS = '''
import os, time, sys
import torch
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
pid = os.fork()
if pid == 0:  # the child: never returns on its own
    time.sleep(3600)
    os._exit(0)
open("child.pid", "w").write(str(pid))
for step in range(6):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
'''


@pytest.mark.slow
def test_nothing_a_script_forks_outlives_the_probe(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "forks.py").write_text(FORKS)
    CliRunner().invoke(cli, ["probe", "--script", "forks.py", "--ledger", "l.db", "--timeout", "120"])
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):  # SIGKILL is asynchronous: the child is gone within moments
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        try:
            if os.waitpid(child, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:
            pass
        time.sleep(0.1)
    os.kill(child, 9)
    raise AssertionError(f"the script's child {child} outlived the probe")
