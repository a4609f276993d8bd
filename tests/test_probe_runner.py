"""Worker isolation: every failure becomes a verdict on a line, nothing written is lost, reruns resume."""

import json
import signal
import time

import pytest

from planner.ledger import read_lines
from planner.records import PHASES, ProbeConfig
from tests.conftest import TINY, WORKLOADS, start_hung_pilot

pytest.importorskip("torch")
from probes.runner import run_grid  # noqa: E402


def cfg(workload="builtin:gpt", params=None, **kw):
    kw.setdefault("seq_len", 16)
    kw.setdefault("eval_seq_len", 16)
    return ProbeConfig(workload=workload, params_json=json.dumps({**TINY, **(params or {})}, sort_keys=True), **kw)


def quiet(msg):
    pass


def lines_of(ledger, run_id):
    df = read_lines(ledger)
    return df[df.run_id == run_id].set_index("phase")


@pytest.mark.slow
def test_nonfinite_names_the_update_and_spares_other_configs(ledger_path):
    bad = cfg(f"{WORKLOADS}:nan_at", {"update": 3})
    good = cfg()
    res = run_grid([bad, good], ledger_path, progress=quiet)
    first = lines_of(ledger_path, res.run_ids[0])
    assert first.loc["steady", "verdict"] == "nonfinite"
    assert first.loc["steady", "nonfinite_update"] == 3
    assert "update 3" in first.loc["steady", "detail"]
    assert first.loc["first_step", "verdict"] == "ok"
    assert (first.loc[["eval", "save", "export", "resume"], "verdict"] == "skipped").all()
    second = lines_of(ledger_path, res.run_ids[1])
    assert (second["verdict"] == "ok").all() and len(second) == len(PHASES)


@pytest.mark.slow
def test_sigkilled_worker_gets_a_killed_line_and_rerun_adds_no_duplicates(ledger_path):
    killer = cfg(f"{WORKLOADS}:die_in", {"how": "sigkill"})
    good = cfg(micro_batch=2)
    res = run_grid([killer, good], ledger_path, progress=quiet)
    first = lines_of(ledger_path, res.run_ids[0])
    assert list(first.index) == list(PHASES)  # one line per phase, none lost
    assert (first.loc[["setup", "first_step", "steady"], "verdict"] == "ok").all()  # earlier lines intact
    assert first.loc["eval", "verdict"] == "killed" and "signal 9" in first.loc["eval", "detail"]
    assert (first.loc[["save", "export", "resume"], "verdict"] == "skipped").all()
    n = len(read_lines(ledger_path))
    again = run_grid([killer, good], ledger_path, progress=quiet)  # both skipped: finished / failed
    assert len(read_lines(ledger_path)) == n
    # What stands for each configuration is its earlier run, line for line as the ledger holds it
    assert again.run_ids == res.run_ids and again.lines == res.lines
    retry = run_grid([killer, good], ledger_path, retry_failed=True, progress=quiet)
    assert retry.run_ids[0] not in res.run_ids  # a retry is a new run id
    assert retry.run_ids[1:] == res.run_ids[1:]  # the finished one still stands
    df = read_lines(ledger_path)
    assert len(df) == n + len(PHASES)
    assert not df.duplicated(["run_id", "phase"]).any()


@pytest.mark.slow
def test_hung_worker_times_out_and_the_next_config_runs(ledger_path):
    hang = cfg(f"{WORKLOADS}:die_in", {"how": "hang"})
    t0 = time.monotonic()
    res = run_grid([hang, cfg()], ledger_path, timeout_s=8, progress=quiet)
    assert time.monotonic() - t0 < 60
    first = lines_of(ledger_path, res.run_ids[0])
    assert first.loc["eval", "verdict"] == "timeout"
    assert (lines_of(ledger_path, res.run_ids[1])["verdict"] == "ok").all()


def test_exception_in_a_phase_is_an_error_line_with_its_last_line(ledger_path):
    res = run_grid([cfg(f"{WORKLOADS}:die_in", {"how": "raise"})], ledger_path, progress=quiet)
    first = lines_of(ledger_path, res.run_ids[0])
    assert first.loc["eval", "verdict"] == "error"
    assert "boom: simulated illegal memory access" in first.loc["eval", "detail"]


@pytest.mark.slow
def test_cap_below_need_gives_oom_lines_through_workers(ledger_path):
    res = run_grid([cfg(cap="tiny", cap_bytes=200_000), cfg(micro_batch=2, cap="1GiB", cap_bytes=2**30)],
                   ledger_path, progress=quiet)
    assert "oom" in set(lines_of(ledger_path, res.run_ids[0])["verdict"])
    assert (lines_of(ledger_path, res.run_ids[1])["verdict"] == "ok").all()


@pytest.mark.slow
def test_ctrl_c_leaves_ledger_consistent_and_rerun_completes(tmp_path):
    ledger = str(tmp_path / "l.db")
    proc = start_hung_pilot("probe", ledger, 3, "--device", "cpu")  # stuck in eval
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "rerun" in err
    df = read_lines(ledger)
    assert df.iloc[-1]["verdict"] == "interrupted" and df.iloc[-1]["phase"] == "eval"
    assert list(df["verdict"][:3]) == ["ok", "ok", "ok"]


def _processes_with(marker: str) -> list[int]:
    import os

    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found


@pytest.mark.slow
@pytest.mark.parametrize("command", ["probe", "estimate"])
def test_workers_go_quietly_when_the_main_process_is_killed(tmp_path, monkeypatch, command):
    """User: `kill -9` of the main process during an estimate grid made a worker print a BrokenPipeError traceback
    (and a hung worker would run on, holding its memory). Now every process it started is gone within seconds,
    without a word."""
    import os
    import uuid

    marker = f"RENTPLAN_TEST_MARK={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    proc = start_hung_pilot(command, str(tmp_path / "l.db"), 3, *(["--device", "cpu"] if command == "probe" else []))
    assert len(_processes_with(marker)) >= 3  # main, forkserver, worker
    proc.kill()
    _, err = proc.communicate(timeout=30)
    deadline = time.monotonic() + 15
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, [open(f"/proc/{p}/cmdline").read() for p in left if os.path.exists(f"/proc/{p}")]
    assert "Traceback" not in err and "BrokenPipe" not in err, err
