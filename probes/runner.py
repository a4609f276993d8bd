"""Runs a grid of configurations, each in its own worker process, and writes every line to the ledger.

Workers are forked from a forkserver that has torch preloaded, so a fresh process per configuration
is cheap. The parent is the only ledger writer: a worker sends each line as its phase ends, and the
parent commits it at once. A worker that dies (OOM-killer, SIGKILL, segfault), hangs past the timeout
or is interrupted still gets a line for the phase it was in; phases it never reached are `skipped`.
Rerunning skips finished configurations; failed ones rerun only with retry_failed, under a new run id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pandas as pd

from planner.errors import InputError, sigterm_as_interrupt
from planner.ledger import Ledger, holding, lines_frame, new_id
from planner.records import PHASES, Line, ProbeConfig, Verdict
from probes.distributed import init_fake_process_group
from probes.ranks import launch, rank_file

DEFAULT_TIMEOUT_S = 900.0
_CTX = None
_START_LOCK = threading.Lock()


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # the workers' entry point (this module: pandas, via the ledger), then probes/warm.py's warm-up; warm.py
        # does not import this module itself, so that the rank a launcher spawns (probes/ranks.py) warms up
        # without a circle back to here
        _CTX.set_forkserver_preload(["probes.runner", "probes.warm"])
    return _CTX


def start_workers() -> None:
    """Start the forkserver now (it imports torch and warms up in the background), so that its start
    overlaps with whatever the caller does next instead of delaying the first configuration."""
    from multiprocessing import forkserver

    _context()
    with _main_module_hidden(), _ctrl_c_not_inherited():
        forkserver.ensure_running()


@contextlib.contextmanager
def _ctrl_c_not_inherited():
    """The forkserver is a new interpreter that imports torch (seconds) before it ignores ^C itself
    (multiprocessing/forkserver.py, main: the preload comes before its SIGINT handler); a terminal's Ctrl-C reaches
    the whole process group, so it printed its own KeyboardInterrupt traceback there. Started with SIGINT ignored,
    it inherits SIG_IGN through exec, and Python then installs no KeyboardInterrupt handler (signal's
    initialisation keeps an ignored SIGINT ignored). The parent ignores ^C only while it spawns (milliseconds);
    a thread other than the main one cannot set handlers, and a handler set outside Python (getsignal: None) could
    not be put back: both start it as before."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _main_module_hidden():
    """Workers never need the parent's __main__ (a pytest runner, a console script); without this the
    forkserver would re-import it in every worker, or refuse when it is not import-safe."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            if k == "__spec__":
                main.__spec__ = None
            else:
                del main.__dict__[k]
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


@contextlib.contextmanager
def _environment(env: dict):
    """os.environ with env set, for the duration of a spawn (the child copies it at start)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _go_with_parent(conn) -> None:
    """When the main process dies (a kill -9, the OOM killer), nobody is left to read what this worker says: it and
    everything it started (its process group) go at once, without a word, instead of running on or printing a
    BrokenPipeError. The sign is the worker's pipe to the main process: its read end closes with that process
    (Linux reports POLLERR on the write end). Its parent is no sign: the forkserver lives while any worker does,
    each holding the forkserver's alive pipe (multiprocessing/forkserver.py, _serve_one)."""
    import select

    def watch():
        poll = select.poll()
        poll.register(conn.fileno(), select.POLLERR)
        while not poll.poll():
            pass
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, name="rentplan-parent-watch", daemon=True).start()


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError):  # the parent is gone (_go_with_parent)
        os.killpg(os.getpgrp(), signal.SIGKILL)


def _worker_main(phases: tuple[str, ...], cfg_dict: dict, workdir: str, run_id: str, probe_id: str, conn) -> None:
    os.setpgrp()  # own process group: the parent can kill the worker and anything it started
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _go_with_parent(conn)
    from probes.pilot import Pilot

    def emit(kind, payload):
        _send(conn, (kind, payload))

    try:
        cfg = ProbeConfig(**cfg_dict)
        if cfg.world_size > 1:  # only estimates get here: rank 0 of N on a process group that sends nothing
            init_fake_process_group(cfg.world_size)
        Pilot(cfg, workdir, emit, run_id, probe_id).run(phases)
    except BaseException as e:  # noqa: BLE001  a setup failure before any phase: report, do not hide
        from probes.pilot import last_line

        _send(conn, ("fatal", last_line(e)))
    finally:
        _send(conn, ("done", None))
        conn.close()


def _call_main(fn, args, conn) -> None:
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _go_with_parent(conn)
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001
        from probes.pilot import last_line

        result = ("error", last_line(e))
    # Plain pickle bytes: multiprocessing's own pickler would pass tensors as shared-memory handles
    # that die with this process. The receiver is our own parent, so unpickling is safe.
    try:
        conn.send_bytes(pickle.dumps(result))
    except (BrokenPipeError, ConnectionResetError):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        conn.close()


class WorkerLost(RuntimeError):
    """The worker timed out or died without a result (a failure inside it is a plain RuntimeError); verdict says
    which (timeout | killed)."""

    def __init__(self, message: str, verdict: str):
        super().__init__(message)
        self.verdict = verdict


def call_in_worker(fn, args: tuple, timeout_s: float = DEFAULT_TIMEOUT_S, env: dict | None = None):
    """Run fn(*args) in a fresh forkserver worker and return its result; failures raise RuntimeError.
    With env, the worker is a newly spawned interpreter started with those environment variables (forked
    workers share the forkserver's interpreter state, e.g. its PYTHONHASHSEED)."""
    if env is None:
        start_workers()
    ctx = _context() if env is None else mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call_main, args=(fn, args, child))
    with _main_module_hidden(), _environment(env or {}):
        proc.start()
    child.close()
    timed_out = False
    try:
        if not parent.poll(timeout_s):
            timed_out = True
            raise WorkerLost(f"worker timed out after {timeout_s:.0f} s", Verdict.TIMEOUT.value)
        try:
            kind, payload = pickle.loads(parent.recv_bytes())
        except EOFError:
            proc.join(5)
            raise WorkerLost(f"worker died (exit code {proc.exitcode})", Verdict.KILLED.value) from None
        if kind == "error":
            raise RuntimeError(payload)
        return payload
    finally:
        if timed_out:
            _kill(proc)
        proc.join(10)
        if proc.is_alive():
            _kill(proc)
        _end_group(proc)
        parent.close()


@dataclass
class WorkerOutcome:
    lines: list[Line] = field(default_factory=list)  # made from the worker's dicts once, as they arrive
    env: dict = field(default_factory=dict)
    in_flight: str | None = None
    fatal: str = ""
    verdict: Verdict | None = None  # set when the process itself failed (killed, timeout, interrupted)
    detail: str = ""


def _run_worker(phases, cfg: ProbeConfig, workdir: str, run_id: str, probe_id: str, timeout_s: float,
                on_line: Callable[[Line], None], on_phase: Callable[[str], None],
                stop: threading.Event | None = None) -> WorkerOutcome:
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker_main, args=(phases, dataclasses.asdict(cfg), workdir, run_id, probe_id, child))
    with _START_LOCK, _main_module_hidden():  # __main__ is shared: one start at a time
        proc.start()
    child.close()
    out = WorkerOutcome()
    deadline = time.monotonic() + timeout_s
    done = False
    try:
        while not done:
            if stop is not None and stop.is_set():  # the grid was interrupted (in the main thread)
                raise KeyboardInterrupt
            left = deadline - time.monotonic()
            if left <= 0:
                out.verdict, out.detail = Verdict.TIMEOUT, f"no progress within the {timeout_s:.0f} s timeout"
                break
            if parent.poll(min(left, 0.5)):
                try:
                    kind, payload = parent.recv()
                except (EOFError, OSError):
                    break  # the worker died: its exit code says how
                if kind == "env":
                    out.env = payload
                elif kind == "phase":
                    out.in_flight = payload
                    on_phase(payload)
                elif kind == "line":
                    line = Line(**payload)
                    out.lines.append(line)
                    out.in_flight = None
                    on_line(line)
                elif kind == "fatal":
                    out.fatal = payload
                elif kind == "done":
                    done = True
            elif not proc.is_alive() and not parent.poll():
                break
    except KeyboardInterrupt:
        out.verdict, out.detail = Verdict.INTERRUPTED, "interrupted (Ctrl-C or SIGTERM)"
    finally:
        if not done:
            _kill(proc)
        proc.join(10)
        _end_group(proc)
        parent.close()
    if out.verdict is None and not done:
        code = proc.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            out.verdict, out.detail = Verdict.KILLED, f"killed by signal {-code} ({name})"
        else:
            out.verdict, out.detail = Verdict.ERROR, f"worker exited with code {code} without a line"
    return out


def _end_group(proc) -> None:
    """Whatever the worker started and left behind (a script's os.fork(), a dataloader's workers) dies with its
    configuration: the worker made its own process group (os.setpgrp), and nothing of it outlives the command."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty: nothing was left


def _kill(proc) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except Exception:  # noqa: BLE001
            pass


def _missing_lines(cfg: ProbeConfig, phases, out: WorkerOutcome, run_id: str, probe_id: str, env: dict,
                   cause: tuple[str, str] | None = None, rank: int = 0) -> list[Line]:
    """Lines the worker could not write. Phases run in order, so the first missing phase is the one in
    flight when the worker failed; it gets the failure's verdict and the phases after it are `skipped`."""
    written = {ln.phase for ln in out.lines}
    if cause is None:
        cause = next(((ln.phase, ln.verdict) for ln in out.lines if ln.verdict != Verdict.OK.value), None)
    base_env = {"device": cfg.device, "device_name": "", "device_total_bytes": None, "torch_version": "",
                "cuda_version": None, "host": ""}
    base_env.update({k: v for k, v in env.items() if k in base_env})
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = []
    for phase in (p for p in phases if p not in written):
        if cause is None:
            verdict = out.verdict or Verdict.ERROR
            detail = out.detail or out.fatal or "worker ended without a line"
            cause = (phase, verdict.value)
        elif cause[1] == Verdict.INTERRUPTED.value:
            break  # an interrupted run is incomplete, not failed: it reruns next time
        else:
            verdict, detail = Verdict.SKIPPED, f"not reached: {cause[0]} ended {cause[1]}"
        lines.append(Line.from_config(cfg, run_id=run_id, probe_id=probe_id, phase=phase, verdict=verdict.value,
                                      started_at=now, detail=detail, rank=rank, **base_env))
    return lines


@dataclass
class GridResult:
    """What stands for each configuration: the lines of the run made now, or of the earlier run it was skipped for
    (finished, or failed without --retry-failed); none for one another probe is running."""

    lines: list[Line] = field(default_factory=list)
    interrupted: bool = False

    @property
    def run_ids(self) -> list[str]:
        return list(dict.fromkeys(ln.run_id for ln in self.lines))

    def frame(self) -> pd.DataFrame:
        return lines_frame(self.lines)


def estimate_jobs(count: int) -> int:
    """How many estimates run side by side: one per core this process may use (an estimate is one busy Python
    thread on fake tensors), no more than there are configurations, and no more than RENTPLAN_JOBS when set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = jobs_limit()
    return max(1, min(cores, limit or cores, count))


def jobs_limit() -> int | None:
    """RENTPLAN_JOBS as a number of estimates side by side (None when unset or empty); anything else is refused."""
    raw = os.environ.get("RENTPLAN_JOBS", "").strip()
    if not raw:
        return None
    if not raw.isascii() or not raw.isdigit() or int(raw) < 1:
        raise InputError(f"RENTPLAN_JOBS={raw[:40]!r}: a whole number of estimates to run side by side, 1 or more. "
                         "Set it so (e.g. RENTPLAN_JOBS=2), or unset it for one per usable core.")
    return int(raw)


def run_grid(configs: list[ProbeConfig], ledger_path: str | Path, *, timeout_s: float = DEFAULT_TIMEOUT_S,
             retry_failed: bool = False, workdir: str | None = None,
             progress: Callable[[str], None] | None = None, jobs: int | None = None) -> GridResult:
    """Run every configuration not already finished. Lines go to the ledger as they come; the result holds the
    lines that stand for each configuration (this run's, or the earlier run's it was skipped for).

    Estimates (mode=estimated) run `jobs` at a time (default: estimate_jobs), each worker with its own ledger
    handle; a measured configuration always runs alone, after the estimates before it have ended, so that no
    other work shares the machine while it is timed."""
    progress = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    probe_id = new_id("p")
    result = GridResult()
    own_tmp = workdir is None
    for name in clean_stale_temporaries(tempfile.gettempdir()):
        progress(f"removed {name}: temporary checkpoints of a probe that was killed")
    workdir = workdir or tempfile.mkdtemp(prefix=f"rentplan-pilot-{os.getpid()}-")
    previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)
    try:
        with Ledger(ledger_path) as ledger:
            status = ledger.run_status()
            todo = []
            for cfg in configs:
                state = status.get(cfg.key(), {}).get("state")
                if state == "done" or (state == "failed" and not retry_failed):
                    result.lines += ledger.standing_lines(cfg.key())
                    why = "finished" if state == "done" else "failed earlier (pass --retry-failed to rerun)"
                    progress(f"skip {cfg.label()}: {why}")
                else:
                    todo.append(cfg)
            if todo:
                start_workers()  # from this (main) thread, so that the forkserver never sees a terminal's ^C
            tagged = [(cfg, f"[{i}/{len(todo)}] {cfg.label()}") for i, cfg in enumerate(todo, 1)]
            run = dict(ledger_path=ledger_path, workdir=workdir, probe_id=probe_id, timeout_s=timeout_s,
                       retry_failed=retry_failed, progress=progress, keep=result.lines.append)
            for estimated, group in itertools.groupby(tagged, key=lambda ct: ct[0].mode == "estimated"):
                group = list(group)
                n = (jobs if jobs is not None else estimate_jobs(len(group))) if estimated else 1
                if n > 1 and len(group) > 1:
                    ok = _run_side_by_side(group, min(n, len(group)), run)
                else:
                    ok = all(_claim_and_run(ledger, cfg, tag, **run) for cfg, tag in group)
                if not ok:
                    result.interrupted = True
                    break
    finally:
        signal.signal(signal.SIGTERM, previous)
        if own_tmp:
            _rmtree(workdir)
    order = {cfg.key(): i for i, cfg in reversed(list(enumerate(configs)))}
    result.lines.sort(key=lambda ln: order.get(ln.config_key, len(order)))  # the configurations' order (stable)
    return result


def _claim_and_run(ledger: Ledger, cfg: ProbeConfig, tag: str, *, ledger_path, workdir, probe_id, timeout_s,
                   retry_failed, progress, keep, stop=None) -> bool:
    """One configuration: claimed in the ledger, run unless another probe holds it or finished it meanwhile,
    released. False when interrupted."""
    run_id = new_id("r")
    holder = ledger.claim(cfg.key(), run_id)
    if holder is not None:  # another probe is running it now: its lines will be in this ledger
        progress(f"skip {tag}: claimed by run {holder['run_id']} (pid {holder['pid']} on "
                 f"{holder['host']}), running now")
        return True
    try:
        state = ledger.run_status().get(cfg.key(), {}).get("state")
        if state == "done" or (state == "failed" and not retry_failed):  # finished meanwhile
            for line in ledger.standing_lines(cfg.key()):
                keep(line)
            progress(f"skip {tag}: finished by another probe meanwhile")
            return True
        with holding(ledger.path, cfg.key(), run_id):
            return _run_config(cfg, ledger, workdir, run_id, probe_id, timeout_s, tag, progress, keep, stop)
    finally:
        ledger.release(cfg.key(), run_id)


def _run_side_by_side(group, jobs: int, run: dict) -> bool:
    """Estimates `jobs` at a time, each thread with its own ledger handle (SQLite handles are per thread; WAL
    lets them commit one line at a time side by side). Ctrl-C or SIGTERM reach the main thread: it tells every
    thread to stop, each ends its worker as a lone run would (its phase in flight gets an `interrupted` line, so
    it reruns next time), and configurations not yet started are left for the next run. False when interrupted."""
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    stop = threading.Event()

    def one(cfg, tag) -> bool:
        if stop.is_set():
            return False
        with Ledger(run["ledger_path"]) as own:
            return _claim_and_run(own, cfg, tag, **run, stop=stop)

    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="rentplan-estimate")
    futures = [pool.submit(one, cfg, tag) for cfg, tag in group]
    try:
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except KeyboardInterrupt:
            pass
        stop.set()  # interrupted, or one thread raised: the others end their workers; else all are done
        wait(futures)
        return all(f.result() for f in futures)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


_STALE = re.compile(r"(?:rentplan-pilot-(\d+)-.*|.*\.tmp-(\d+))")


def clean_stale_temporaries(folder, live_pids: set[int] | None = None) -> list[str]:
    """Remove what a killed probe or run left in folder: pilot folders `rentplan-pilot-PID-*` and half-written
    `*.tmp-PID` files whose process is gone. Returns the names removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _STALE.fullmatch(entry.name)
        if not m or entry.is_symlink():
            continue
        pid = int(m.group(1) or m.group(2))
        if (live_pids is not None and pid in live_pids) or (live_pids is None and _pid_alive(pid)):
            continue
        try:
            if entry.is_dir():
                _rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass  # someone else's file, or already gone: not ours to insist on
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _launch_main(phases, cfg_dict, workdir, run_id, probe_id, conn) -> None:
    os.setpgrp()  # the launcher and every rank share this group: one killpg ends them all
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        launch(phases, cfg_dict, workdir, run_id, probe_id)
        conn.send(("done", ""))
    except BaseException as e:  # noqa: BLE001  ChildFailedError: a rank failed; its own line says how
        from probes.pilot import last_line

        conn.send(("failed", last_line(e)))
    finally:
        conn.close()


def _read_rank_files(workdir: str, run_id: str, phases, world: int, offsets: dict, outs: dict, on_line,
                     on_phase) -> None:
    for rank in range(world):
        path = rank_file(workdir, run_id, rank, phases[0])
        if not os.path.exists(path):
            continue
        with open(path) as f:
            f.seek(offsets.get(rank, 0))
            for raw in f:
                if not raw.endswith("\n"):
                    break  # a torn last line: read it next time, complete
                offsets[rank] = offsets.get(rank, 0) + len(raw.encode())
                kind, payload = json.loads(raw)
                out = outs[rank]
                if kind == "env":
                    out.env = payload
                elif kind == "phase":
                    out.in_flight = payload
                    on_phase(rank, payload)
                elif kind == "line":
                    line = Line(**payload)
                    out.lines.append(line)
                    out.in_flight = None
                    on_line(line)
                elif kind == "fatal":
                    out.fatal = payload


def _run_ranks(phases, cfg: ProbeConfig, workdir, run_id, probe_id, timeout_s, on_line, on_phase) -> dict:
    """Launch cfg.world_size ranks; return WorkerOutcome per rank (lines, in-flight phase, failure)."""
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_launch_main, args=(phases, dataclasses.asdict(cfg), workdir, run_id, probe_id, child))
    with _main_module_hidden():
        proc.start()
    child.close()
    outs = {r: WorkerOutcome() for r in range(cfg.world_size)}
    offsets: dict = {}
    deadline = time.monotonic() + timeout_s
    status, message = None, ""
    try:
        while status is None:
            if time.monotonic() > deadline:
                status, message = "timeout", f"no result within the {timeout_s:.0f} s timeout (all ranks stopped)"
                break
            if parent.poll(0.3):
                try:
                    status, message = parent.recv()
                except (EOFError, OSError):
                    status, message = "died", f"launcher died (exit code {proc.exitcode})"
            elif not proc.is_alive():
                status, message = "died", f"launcher died (exit code {proc.exitcode})"
            _read_rank_files(workdir, run_id, phases, cfg.world_size, offsets, outs, on_line, on_phase)
    except KeyboardInterrupt:
        status, message = "interrupted", "interrupted (Ctrl-C or SIGTERM)"
    finally:
        if status != "done":
            _kill(proc)
        proc.join(10)
        parent.close()
    _read_rank_files(workdir, run_id, phases, cfg.world_size, offsets, outs, on_line, on_phase)
    if status != "done":
        failed = [(r, o) for r, o in outs.items() if any(ln.verdict != Verdict.OK.value for ln in o.lines)]
        why = (f"stopped after rank {failed[0][0]} failed in "
               f"{next(ln.phase for ln in failed[0][1].lines if ln.verdict != Verdict.OK.value)}"
               if failed else message)
        verdict = {"timeout": Verdict.TIMEOUT, "interrupted": Verdict.INTERRUPTED}.get(status, Verdict.KILLED)
        # a rank that could not start said why in its file; the launcher's own message is a banner of '='
        cause = next((o.fatal for o in outs.values() if o.fatal), "") or message
        for o in outs.values():
            if o in (x for _, x in failed):
                continue
            o.verdict = Verdict.ERROR if (status == "failed" and not failed) else verdict
            o.detail = cause if (status == "failed" and not failed) else why
    return outs


def _committer(ledger: Ledger, keep: Callable[[Line], None]) -> Callable[[list[Line]], None]:
    """Lines go to the ledger (committed one by one) and to the grid's result, the same objects."""
    def commit(lines: list[Line]) -> None:
        for line in lines:
            ledger.append(line)
            keep(line)
    return commit


def _run_config(cfg, ledger, workdir, run_id, probe_id, timeout_s, tag, progress, keep, stop=None) -> bool:
    """Run one configuration (training worker, then a fresh resume worker). False when interrupted."""
    commit = _committer(ledger, keep)
    if cfg.world_size > 1 and cfg.mode == "measured":
        return _run_config_ranks(cfg, workdir, run_id, probe_id, timeout_s, tag, progress, commit)
    env: dict = {}
    # The resume phase runs in a fresh worker, as a restarted job would; an estimate holds no memory of its
    # own, so it resumes in the same worker once its training state is dropped.
    train, resume = (PHASES, ()) if cfg.mode == "estimated" else (PHASES[:-1], PHASES[-1:])
    for phases in (p for p in (train, resume) if p):
        out = _run_worker(phases, cfg, workdir, run_id, probe_id, timeout_s,
                          on_line=lambda ln: commit([ln]),
                          on_phase=lambda ph: progress(f"{tag} · {ph}"), stop=stop)
        env = out.env or env
        extra = _missing_lines(cfg, phases, out, run_id, probe_id, env)
        commit(extra)
        if out.verdict is Verdict.INTERRUPTED:
            return False
        failed = [ln for ln in out.lines + extra if ln.verdict != Verdict.OK.value]
        if failed:
            if phases is train and resume:  # resume needs the checkpoint: not reached
                cause = (failed[0].phase, failed[0].verdict)
                commit(_missing_lines(cfg, resume, WorkerOutcome(), run_id, probe_id, env, cause))
            break
    _remove_run_files(workdir, run_id)
    return True


def _remove_run_files(workdir: str, run_id: str) -> None:
    """Checkpoints, exports and rank files of a run are scratch: the ledger keeps what was measured."""
    import shutil

    for name in os.listdir(workdir):
        if name.startswith(run_id):
            path = os.path.join(workdir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _run_config_ranks(cfg, workdir, run_id, probe_id, timeout_s, tag, progress, commit) -> bool:
    """The distributed twin of _run_config: one line per phase per rank."""
    train, resume = PHASES[:-1], PHASES[-1:]
    causes: dict[int, tuple[str, str]] = {}
    for phases in (train, resume):
        if causes:  # resume needs the checkpoint: not reached on any rank
            for r in range(cfg.world_size):
                cause = causes.get(r) or next(iter(causes.values()))
                commit(_missing_lines(cfg, phases, WorkerOutcome(), run_id, probe_id, {}, cause, rank=r))
            break
        outs = _run_ranks(phases, cfg, workdir, run_id, probe_id, timeout_s,
                          on_line=lambda ln: commit([ln]),
                          on_phase=lambda r, ph: progress(f"{tag} · rank {r} · {ph}"))
        interrupted = False
        for r, out in outs.items():
            extra = _missing_lines(cfg, phases, out, run_id, probe_id, out.env, rank=r)
            commit(extra)
            interrupted |= out.verdict is Verdict.INTERRUPTED
            bad = [ln for ln in out.lines + extra if ln.verdict != Verdict.OK.value]
            if bad:
                causes[r] = (bad[0].phase, bad[0].verdict)
        if interrupted:
            return False
    _remove_run_files(workdir, run_id)
    return True


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
