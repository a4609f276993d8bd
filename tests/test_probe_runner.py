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


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM], ids=["int", "term"])
def test_a_second_signal_while_the_command_exits_still_exits_130(tmp_path, second):
    """A fresh-clone attack: Ctrl-C, then Ctrl-C again (or SIGTERM twice, as a scheduler may) while the command was
    ending: it had printed "Interrupted" but died by the second signal (-2, -15), for Python restores the default
    handlers before it tears down (signal's _PySignal_Fini) and the teardown of torch takes half a second."""
    ledger = str(tmp_path / "l.db")
    proc = start_hung_pilot("probe", ledger, 3, "--device", "cpu")  # stuck in eval
    proc.send_signal(signal.SIGINT if second == signal.SIGINT else signal.SIGTERM)
    time.sleep(0.15)
    proc.send_signal(second)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err
    assert read_lines(ledger).iloc[-1]["verdict"] == "interrupted"


def test_starting_the_workers_puts_back_the_callers_ctrl_c_handler(monkeypatch):
    """The forkserver starts with ^C ignored (it inherits that); the caller's handler is back afterwards, and a
    handler set outside Python (signal.getsignal gives None: it cannot be put back) is left alone."""
    import threading

    import probes.runner as runner

    def during():
        seen.append(signal.getsignal(signal.SIGINT))

    from multiprocessing import forkserver

    seen: list = []
    monkeypatch.setattr(forkserver, "ensure_running", during)
    mine = signal.getsignal(signal.SIGINT)
    runner.start_workers()
    assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is mine
    monkeypatch.setattr(signal, "getsignal", lambda sig: None)  # as under a host whose C code installed it
    set_calls: list = []
    monkeypatch.setattr(signal, "signal", lambda *a: set_calls.append(a))
    runner.start_workers()
    assert set_calls == [] and len(seen) == 2
    t = threading.Thread(target=runner.start_workers)  # another thread cannot set handlers: starts it as before
    t.start()
    t.join()
    assert set_calls == [] and len(seen) == 3


@pytest.mark.slow  # a probe in a second process, interrupted while its forkserver imports torch
def test_a_terminal_ctrl_c_while_the_workers_start_prints_no_traceback(tmp_path):
    """A fresh-clone attack: Ctrl-C in a terminal (SIGINT to the whole process group) in the first seconds of
    `probe` printed the forkserver's own "Traceback ... KeyboardInterrupt" (raised in probes/warm.py's torch
    imports, before multiprocessing's forkserver ignores ^C) beside rentplan's "Interrupted" line."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    args = [sys.executable, "-m", "planner", "probe", "--ledger", str(tmp_path / "l.db"), "-w", f"{WORKLOADS}:die_in",
            "-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64", "--seq-len", "16",
            "--device", "cpu"]
    proc = subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # its group: the terminal's

    def forkserver() -> bool:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                if b"forkserver" in cmd and os.getpgid(int(pid)) == proc.pid:
                    return True
            except OSError:
                pass
        return False

    deadline = time.monotonic() + 60
    while not forkserver() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert forkserver(), "the probe started no forkserver"
    time.sleep(0.3)  # inside its imports (torch takes seconds)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    time.sleep(1.0)  # the forkserver writes to the same stderr: let a late traceback arrive in the pipe's reader
    assert proc.returncode == 130, err
    assert "Interrupted" in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err


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


PARTS = '''"""The model's blocks, in a module beside the workload (as a UNet's code is usually split)."""
import torch.nn as nn


class Denoiser(nn.Module):
    def __init__(self, channels=3, width=8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, channels, 3,
                                                                                                  padding=1))

    def forward(self, x):
        return self.net(x)
'''

DENOISE = '''"""A denoiser workload that imports its model from the module beside it."""
import zlib

import torch
import torch.nn.functional as F

from denoise_parts import Denoiser


class Denoising:
    name = "denoiser"

    def build_model(self):
        return Denoiser()

    def make_batch(self, split, index, micro_batch, seq_len):
        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        clean = torch.rand(micro_batch, 3, seq_len, seq_len, generator=g)
        return {"noisy": clean + 0.1 * torch.randn(clean.shape, generator=g), "clean": clean}

    def compute_loss(self, model, batch):
        return F.mse_loss(model(batch["noisy"]), batch["clean"])


def denoiser():
    return Denoising()
'''


@pytest.mark.slow
def test_a_workload_that_imports_a_module_beside_it_runs_in_workers_and_ranks(tmp_path):
    """User (#44): `probe -w proj/denoise.py:denoiser`, whose file does `from denoise_parts import Denoiser`, failed
    with ModuleNotFoundError unless PYTHONPATH was set. Python puts a script's folder on sys.path; so does rentplan,
    in the command, in each worker and in each rank."""
    from tests.conftest import rentplan

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "denoise_parts.py").write_text(PARTS)
    (proj / "denoise.py").write_text(DENOISE)
    r = rentplan(tmp_path, "probe", "-w", "proj/denoise.py:denoiser", "--micro-batch", "2", "--seq-len", "8",
                 "--ledger", "l.db", "--device", "cpu")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = rentplan(tmp_path, "probe", "-w", "proj/denoise.py:denoiser", "--micro-batch", "2", "--seq-len", "8",
                 "--ledger", "l.db", "--device", "cpu", "--strategy", "ddp", "--nproc", "2")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    df = read_lines(tmp_path / "l.db")
    assert (df["verdict"] == "ok").all(), df[["phase", "verdict", "detail"]]
    assert len(df[df["world_size"] == 1]) == len(PHASES) and set(df[df["world_size"] == 2]["rank"]) == {0, 1}


FIND = ["probe", "--find", "max-micro-batch", "--cap", "1GiB", "-w", "builtin:gpt", "-p", "layers=1", "-p",
        "d_model=64", "-p", "heads=2", "-p", "vocab=256", "--seq-len", "64", "--device", "cpu", "--ledger", "l.db"]


@pytest.mark.slow
@pytest.mark.parametrize("caller_rss", [None, 640 * 2**20], ids=["fresh", "caller-holds-640MiB"])
def test_find_on_the_cpu_stops_before_a_size_past_the_hosts_free_memory(tmp_path, monkeypatch, caller_rss):
    """User (#44): `probe --find max-micro-batch --cap l4` on a CPU machine used 19 GB of its 23 GB at micro-batch
    2,163, without a word. Here the machine has 700 MiB available (the cap, 1 GiB, is beyond it): the search says
    the host bounds it, and no size it tries grows past what is available.

    CI (stop 49): run late in a long pytest process, whose own RSS (640 MiB here, above the 630 MiB the search
    allows) stood in for a worker's before any real probe, the search refused every size ("no size fits") without
    measuring one. A guess from the caller's RSS never refuses the smallest size: its probe measures a worker."""
    from click.testing import CliRunner

    import probes.search
    from planner.cli import cli

    monkeypatch.chdir(tmp_path)
    available = 700 * 2**20
    monkeypatch.setattr(probes.search, "host_available_bytes", lambda: available)
    if caller_rss is not None:
        monkeypatch.setattr(probes.search, "_rss", lambda: caller_rss)
    r = CliRunner().invoke(cli, FIND)
    assert r.exit_code == 0, r.output
    assert "this machine's available memory" in r.stderr  # said up front, on stderr
    df = read_lines(tmp_path / "l.db")
    real = df[df["mode"] == "measured"]
    assert len(real) and real["device_used_bytes"].max() <= available
    assert "largest micro-batch that ran under cap 1GiB" in r.stdout
    assert "this machine's available memory" in r.stdout.splitlines()[-1]  # the answer names what bounded it
    assert set(real["verdict"]) == {"ok"}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_one_signal_ends_the_whole_find_and_keeps_its_lines(tmp_path, sig):
    """User (#44): Ctrl-C or SIGTERM during `probe --find` stopped only the size in flight, and the search went on
    with 1,081, 540, 270. One signal ends the search: exit 130, the lines measured so far stay in the ledger."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    ledger = tmp_path / "l.db"
    proc = subprocess.Popen([sys.executable, "-m", "planner", *FIND], cwd=tmp_path, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # a real probe is in flight once a measured line is written
            try:
                if ledger.exists() and (read_lines(ledger)["mode"] == "measured").any():
                    break
            except Exception:  # the ledger is being created
                pass
            time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "Interrupted" in err
    real = read_lines(ledger).query("mode == 'measured'")
    assert real["run_id"].nunique() == 1  # the search tried no other size after the signal
    assert real.iloc[-1]["verdict"] == "interrupted"
    assert (real["verdict"].iloc[:-1] == "ok").all()
