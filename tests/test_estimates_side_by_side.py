"""Estimates run side by side (#26, estimates faster where people wait): one worker per core, the same lines as one
at a time, a measured configuration alone, and Ctrl-C stops every worker and leaves a ledger a rerun resumes from."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from planner.ledger import read_lines
from planner.records import PHASES, ProbeConfig
from tests.conftest import ROOT, TINY, WORKLOADS, start_hung_pilot

pytest.importorskip("torch")
from probes.runner import estimate_jobs, run_grid  # noqa: E402


def cfg(workload="builtin:gpt", params=None, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("eval_seq_len", 16)
    kw.setdefault("mode", "estimated")
    kw.setdefault("target", "sm80+")
    return ProbeConfig(workload=workload, params_json=json.dumps({**TINY, **(params or {})}, sort_keys=True), **kw)


def figures(ledger):
    df = read_lines(ledger)
    cols = ["config_key", "phase", "verdict", "peak_allocated_bytes", "peak_reserved_bytes", "detail"]
    return df[cols].sort_values(["config_key", "phase"]).reset_index(drop=True)


@pytest.mark.slow  # estimates in workers
def test_estimates_side_by_side_meet_and_write_what_one_at_a_time_writes(tmp_path):
    folder = tmp_path / "meet"
    folder.mkdir()
    meet = [cfg(f"{WORKLOADS}:meet", {"folder": str(folder), "wait_s": 60}, micro_batch=mb) for mb in (1, 2, 3)]
    res = run_grid(meet, tmp_path / "side.db", progress=lambda m: None, jobs=2)
    assert not res.interrupted
    assert len(list(folder.glob("met-*"))) == 3  # every worker found another at work: they ran side by side
    assert len(res.run_ids) == 3 and len(res.lines) == 3 * len(PHASES)
    assert {ln.verdict for ln in res.lines} == {"ok"}
    assert [ln.micro_batch for ln in res.lines] == sorted(ln.micro_batch for ln in res.lines)  # grid's order

    plain = [cfg(micro_batch=mb) for mb in (1, 2, 3)]
    run_grid(plain, tmp_path / "two.db", progress=lambda m: None, jobs=2)
    run_grid(plain, tmp_path / "one.db", progress=lambda m: None, jobs=1)
    side, alone = figures(tmp_path / "two.db"), figures(tmp_path / "one.db")
    assert len(side) == 3 * len(PHASES)
    assert side.equals(alone), "estimates side by side differ from estimates one at a time"


def test_measured_configurations_run_alone(tmp_path, monkeypatch):
    import probes.runner as runner

    groups = []
    side_by_side = runner._run_side_by_side

    def recorded(group, jobs, run):
        groups.append([c.mode for c, _ in group])
        return side_by_side(group, jobs, run)

    monkeypatch.setattr(runner, "_run_side_by_side", recorded)
    grid = [cfg(micro_batch=1), cfg(micro_batch=2), cfg(micro_batch=1, mode="measured", target=""),
            cfg(micro_batch=3), cfg(micro_batch=4)]
    res = run_grid(grid, tmp_path / "l.db", progress=lambda m: None, jobs=4)
    assert {ln.verdict for ln in res.lines} == {"ok"} and len(res.run_ids) == 5
    assert groups == [["estimated", "estimated"], ["estimated", "estimated"]]  # the measured one ran alone
    assert [ln.mode for ln in res.lines][::len(PHASES)] == [c.mode for c in grid]  # lines in the grid's order


def test_jobs_default_to_usable_cores_and_an_environment_limit(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("RENTPLAN_JOBS", raising=False)
    assert estimate_jobs(100) == cores and estimate_jobs(1) == 1
    monkeypatch.setenv("RENTPLAN_JOBS", "1")
    assert estimate_jobs(100) == 1
    monkeypatch.setenv("RENTPLAN_JOBS", " ")
    assert estimate_jobs(100) == cores


@pytest.mark.parametrize("value", ["0", "abc", "-3", "1.5", "²"])
def test_a_bad_jobs_setting_is_an_error_before_any_file_is_made(tmp_path, value):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RENTPLAN_JOBS": value}
    out = subprocess.run([sys.executable, "-m", "planner", "estimate", "--ledger", str(tmp_path / "l.db"),
                          "-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64", "--seq-len", "16"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Error: RENTPLAN_JOBS=" in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_stops_every_estimate_at_work_and_leaves_them_to_rerun(tmp_path):
    ledger = str(tmp_path / "l.db")
    proc = start_hung_pilot("estimate", ledger, 6, "--micro-batch", "1,2,3", "--target", "sm80+", "--jobs", "2")
    workers = _descendants(proc.pid)
    assert len(workers) >= 3  # the forkserver and the two estimates at work
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    df = read_lines(ledger)
    assert sorted(df["micro_batch"].unique()) == [1, 2]  # the third never started
    for mb, lines in df.groupby("micro_batch"):
        assert list(lines["phase"]) == ["setup", "first_step", "steady", "eval"], mb
        assert list(lines["verdict"]) == ["ok", "ok", "ok", "interrupted"], mb
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)], "a worker outlived the interrupted estimate"
    from planner.ledger import Ledger

    with Ledger(ledger, create=False) as led:  # interrupted is incomplete, not failed: the next run redoes both
        states = {k: v["state"] for k, v in led.run_status().items()}
    assert len(states) == 2 and not {"done", "failed"} & set(states.values()), states


def _descendants(pid: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
