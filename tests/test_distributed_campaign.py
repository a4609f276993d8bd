"""A campaign under torchrun (what sky.yaml starts for ddp/fsdp orders): every process trains its share of each
update, rank 0 alone writes, and DDP, FSDP and one process see the same losses on the same examples."""

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.factories import campaign_yaml

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]

SPEC = campaign_yaml(
    name="ddp-test", params={"layers": 2, "d_model": 64, "heads": 4, "vocab": 256}, precision="fp32", optimizer="adamw",
    seq_len=32, effective_batch=8, updates=4, eval={"every_updates": 2, "examples": 8, "seq_len": 32}, export="model",
    setup_hours=0.1, variants=[{"id": "control", "lr": 1.0e-3, "priority": 1, "micro_batch": 4}])


def campaign(tmp_path, name, launch, extra=()):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "c.yaml").write_text(SPEC)
    cmd = [*launch, "-m", "planner.cli", "campaign", "run", "c.yaml", "--ledger", "l.db", "--out", "runs", *extra]
    r = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    con = sqlite3.connect(folder / "l.db")
    runs = con.execute("SELECT run_id, config_json FROM campaign_runs").fetchall()
    metrics = con.execute("SELECT run_id, update_no, kind, loss FROM campaign_metrics ORDER BY seq").fetchall()
    events = [e for (e,) in con.execute("SELECT event FROM campaign_events ORDER BY seq")]
    con.close()
    return folder, runs, metrics, events, r.stdout


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_campaign_under_torchrun_writes_once_and_learns_as_one_process(tmp_path, strategy):
    one = campaign(tmp_path, "one", [sys.executable])
    folder, runs, metrics, events, out = campaign(tmp_path, strategy, TORCHRUN, ["--strategy", strategy])
    assert len(runs) == 1, "rank 0 alone writes the run"
    cfg = json.loads(runs[0][1])["config"]
    assert (cfg["world_size"], cfg["micro_batch"], cfg["grad_accum"]) == (2, 4, 1)
    assert events == ["started", "finished"]
    # a checkpoint at the first evaluation (the default cadence; ranks save together, FSDP as DCP shards)
    assert [m[2] for m in metrics] == ["setup", "train", "train", "val", "save", "train", "train", "val", "export"]
    assert out.count("1 run: 1 finished") == 1, "one summary line, from rank 0"
    # Process r reads micro-batches index × 2 + r: the two processes together see what one process sees with
    # micro-batch 4 × accumulation 2, so the losses agree (float sums in another order: not bit for bit).
    solo = {(m[1], m[2]): m[3] for m in one[2] if m[3] is not None}
    for _, u, kind, loss in metrics:
        if loss is not None:
            assert loss == pytest.approx(solo[(u, kind)], rel=2e-5), (u, kind)
    r = CliRunner().invoke(cli, ["campaign", "finish", runs[0][0], "--ledger", str(folder / "l.db"),
                                 "--out", str(folder / "runs")])
    assert r.exit_code == 0 and "reproduces the control outputs" in r.output


def test_what_only_another_rank_saw_go_wrong_is_not_lost(capsys):
    """Ranks other than 0 write no ledger rows; their errors (an OOM on rank 1) go to stderr, which torchrun shows."""
    from probes.campaign import _OtherRank

    other = _OtherRank(1, "c-123")
    other.add("campaign_metrics", {"run_id": "c-123", "update_no": 3, "kind": "train", "loss": 2.0})
    other.add("campaign_events", {"run_id": "c-123", "event": "error", "update_no": 3,
                                  "detail": "OutOfMemoryError: CUDA out of memory"})
    err = capsys.readouterr().err
    assert err == "rank 1: run c-123: error at update 3: OutOfMemoryError: CUDA out of memory\n"
