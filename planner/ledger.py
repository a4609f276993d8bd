"""The ledger: an append-only SQLite table of lines. Nothing is ever updated or deleted.

Each line is its own transaction with synchronous=FULL, so a line counts as written only once it is on
disk; a crash loses at most the line being written. pandas reads it for the planner.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Iterable

import pandas as pd

from planner.errors import LedgerError
from planner.records import FAILED, LINE_FIELDS, PHASES, Line, Verdict
from planner.storage import advice, atomic_write, made_or_nothing, storage_problem

SCHEMA_VERSION = 2  # 2: campaign_predictions and claims tables

def _column_type(f: dataclasses.Field) -> str:
    t = str(f.type)
    for name, sql in (("bool", "INTEGER"), ("int", "INTEGER"), ("float", "REAL")):
        if t.startswith(name):
            return sql
    return "TEXT"


_COLUMNS = {f.name: _column_type(f) for f in dataclasses.fields(Line)}

# Campaign tables: append-only like `lines`; a run's status is its latest event, never an edited row.
TABLES = {
    "campaign_runs": {"run_id": "TEXT", "campaign": "TEXT", "variant": "TEXT", "seed": "INTEGER", "lr": "REAL",
                      "config_json": "TEXT", "device": "TEXT", "device_name": "TEXT", "torch_version": "TEXT",
                      "code_revision": "TEXT", "started_at": "TEXT"},
    "campaign_events": {"run_id": "TEXT", "event": "TEXT", "update_no": "INTEGER", "detail": "TEXT", "at": "TEXT"},
    "campaign_metrics": {"run_id": "TEXT", "update_no": "INTEGER", "kind": "TEXT", "loss": "REAL", "lr": "REAL",
                         "accuracy": "REAL", "seconds": "REAL", "at": "TEXT"},
    "campaign_predictions": {"run_id": "TEXT", "update_no": "INTEGER", "item": "TEXT", "prediction": "TEXT",
                             "target": "TEXT"},
    "notes": {"run_id": "TEXT", "text": "TEXT", "at": "TEXT"},
}


def new_id(prefix: str = "r") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class LedgerFull(LedgerError):
    """The ledger's disk filled (or turned read-only) while a command wrote to it."""


class Ledger:
    """A handle on one ledger file. Use as a context manager.

    create=False opens read-only (SQLite mode=ro): a command that only reads never changes the file, not even
    its journal mode. Either way the file must be a rentplan ledger: a foreign SQLite file, or one written by
    a newer rentplan, is refused before anything touches it; an older one is copied to a backup, then migrated.
    """

    def __init__(self, path: str | Path, create: bool = True):
        self.path = Path(path)
        self.read_only = not create
        self.backup: Path | None = None  # where an older ledger was copied before this handle migrated it
        if not create and not self.path.exists():
            raise LedgerError(f"no ledger at {self.path}. Pass --ledger PATH, or make one: `rentplan probe` (pilot "
                              "lines) or `rentplan campaign run SPEC` (campaign runs).")
        if self.path.is_dir():
            raise LedgerError(f"{self.path} is a folder, not a ledger file. Pass --ledger FILE.")
        existed = {p for p in self._companions() if p.exists()} | ({self.path} if self.path.exists() else set())
        self._db: sqlite3.Connection | None = None
        try:
            version = self._check_existing()
            if self.read_only:
                self._db = sqlite3.connect(self._read_only_uri(), uri=True, timeout=30)
                return
            if version is not None and version < SCHEMA_VERSION:
                self.backup = _backup(self.path, version)
            self._db = sqlite3.connect(str(self.path), timeout=30)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self._ensure_schema()
        except (sqlite3.DatabaseError, OSError) as e:
            self._undo_open(existed)
            reason = storage_problem(self.path.parent)
            if reason:  # a full disk or a read-only folder is said as such, not blamed on the file
                raise LedgerError(f"cannot {'read' if self.read_only else 'write'} the ledger {self.path}: "
                                  f"{reason}. Nothing was changed; {advice(reason)} (--ledger PATH on a "
                                  "writable disk).") from None
            if isinstance(e, OSError):
                raise LedgerError(f"cannot open the ledger {self.path}: {e.strerror or e}.") from None
            raise LedgerError(f"{self.path} is not a rentplan ledger ({e}). Pass another --ledger PATH.") from None

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise LedgerError(f"the ledger {self.path} is closed")
        return self._db

    def _companions(self) -> list[Path]:
        return [Path(f"{self.path}-wal"), Path(f"{self.path}-shm"), Path(f"{self.path}-journal")]

    def _undo_open(self, existed: set[Path]) -> None:
        """A failed open leaves the folder as it found it: SQLite's files that this open made (an empty ledger,
        an empty -wal, a torn -shm shorter than its 32 KiB header region) are removed; nothing else is touched."""
        if self._db is not None:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = None
        for p in [self.path, *self._companions()]:
            with contextlib.suppress(OSError):
                if p not in existed and p.is_file() and p.stat().st_size < 32768 and (
                        p != self.path or p.stat().st_size == 0):
                    p.unlink()

    def _read_only_uri(self) -> str:
        """Read-only, and leaving nothing behind: SQLite opens a WAL ledger by creating LEDGER-shm beside it,
        which a read-only handle can neither make in a read-only folder nor remove on close. With no -wal file
        no writer holds the ledger, so it is read as immutable (no -shm, no locks); while a writer is at work
        (its -wal exists) it is read through the writer's -shm."""
        uri = f"{self.path.resolve().as_uri()}?mode=ro"
        if not Path(f"{self.path}-wal").exists():
            uri += "&immutable=1"
        return uri

    def _check_existing(self) -> int | None:
        """The schema version of an existing ledger (None for a new or empty file); refuse anything else."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return None
        con = sqlite3.connect(self._read_only_uri(), uri=True, timeout=30)
        try:
            names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not names and self.read_only:
                raise LedgerError(f"{self.path} is an empty SQLite file, not a rentplan ledger yet.")
            if not names:
                return None
            if not {"meta", "lines"} <= names:
                raise LedgerError(f"{self.path} is not a rentplan ledger (it has tables "
                                  f"{', '.join(sorted(names))}, no meta and lines). Nothing was changed; pass "
                                  "another --ledger PATH.")
            row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        finally:
            con.close()
        try:
            version = int(row[0])
        except (TypeError, ValueError):
            raise LedgerError(f"{self.path} has no readable schema version; it is not a rentplan ledger.") from None
        if version > SCHEMA_VERSION:
            raise LedgerError(f"{self.path} was written by a newer rentplan (ledger schema {version}; this one "
                              f"reads up to {SCHEMA_VERSION}). Nothing was changed; upgrade rentplan.")
        return version

    def _ensure_schema(self) -> None:
        cols = ", ".join(f"{name} {sql}" for name, sql in _COLUMNS.items())
        with self.db:
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            self.db.execute(f"CREATE TABLE IF NOT EXISTS lines (seq INTEGER PRIMARY KEY AUTOINCREMENT, {cols})")
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            self.db.execute("CREATE INDEX IF NOT EXISTS lines_config ON lines (config_key)")
            # Columns added by later versions of Line are appended, never rewritten.
            have = {r[1] for r in self.db.execute("PRAGMA table_info(lines)")}
            for name, sql in _COLUMNS.items():
                if name not in have:
                    self.db.execute(f"ALTER TABLE lines ADD COLUMN {name} {sql}")
            for table, columns in TABLES.items():
                spec = ", ".join(f"{c} {t}" for c, t in columns.items())
                self.db.execute(f"CREATE TABLE IF NOT EXISTS {table} (seq INTEGER PRIMARY KEY AUTOINCREMENT, {spec})")
            # Claims coordinate concurrent probes; unlike lines they are taken and released (not measurements).
            self.db.execute("CREATE TABLE IF NOT EXISTS claims (config_key TEXT PRIMARY KEY, run_id TEXT, "
                            "pid INTEGER, host TEXT, heartbeat REAL)")

    # --- claims: one probe per configuration at a time -------------------------------------------------

    def claim(self, config_key: str, run_id: str, pid: int | None = None, host: str | None = None) -> dict | None:
        """Take the configuration for this run, in one transaction. Returns None when taken, else the live
        holder's claim. A claim whose heartbeat is older than CLAIM_STALE_S, or whose process is gone (same host,
        no such pid), is taken over."""
        pid, host = pid or os.getpid(), host or socket.gethostname()
        with self.db:
            self.db.execute("BEGIN IMMEDIATE")
            row = self.db.execute("SELECT run_id, pid, host, heartbeat FROM claims WHERE config_key = ?",
                                  (config_key,)).fetchone()
            if row is not None and row[0] != run_id and _alive(row[1], row[2], row[3]):
                return {"run_id": row[0], "pid": row[1], "host": row[2]}
            self.db.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?)",
                            (config_key, run_id, pid, host, time.time()))
        return None

    def heartbeat(self, config_key: str, run_id: str) -> None:
        with self.db:
            self.db.execute("UPDATE claims SET heartbeat = ? WHERE config_key = ? AND run_id = ?",
                            (time.time(), config_key, run_id))

    def release(self, config_key: str, run_id: str) -> None:
        with self.db:
            self.db.execute("DELETE FROM claims WHERE config_key = ? AND run_id = ?", (config_key, run_id))

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    def append(self, line: Line) -> None:
        row = line.to_dict()
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._writing():  # one transaction per line: committed (and fsynced) before we return
            self.db.execute(f"INSERT INTO lines ({names}) VALUES ({marks})", list(row.values()))

    def add(self, table: str, row: dict) -> None:
        """Append one row to a campaign table (committed before returning)."""
        cols = TABLES[table]
        unknown = set(row) - set(cols)
        if unknown:
            raise LedgerError(f"unknown columns for {table}: {', '.join(sorted(unknown))}")
        names = ", ".join(row)
        with self._writing():
            self.db.execute(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' for _ in row)})", list(row.values()))

    @contextlib.contextmanager
    def _writing(self):
        """One committed transaction; a disk that fills (or turns read-only) mid-command is said as such, with what
        was kept, never a sqlite traceback."""
        try:
            with self.db:
                yield
        except sqlite3.OperationalError as e:
            reason = storage_problem(self.path.parent) or (str(e) if "full" in str(e) or "readonly" in str(e) else "")
            if not reason:  # not the disk (a lock held too long, say): the error as it is
                raise
            raise LedgerFull(f"the ledger {self.path} cannot take another row: {reason}. Every row written before is "
                             f"kept; {advice(reason)} (--ledger PATH), then run the same command again.") from None

    def table(self, name: str) -> pd.DataFrame:
        if name not in TABLES:
            raise LedgerError(f"unknown table {name!r}")
        have = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if name not in have:  # an older ledger opened read-only: the table is simply empty
            return pd.DataFrame(columns=["seq", *TABLES[name]])
        return pd.read_sql_query(f"SELECT * FROM {name} ORDER BY seq", self.db)

    def extend(self, lines: Iterable[Line]) -> None:
        for line in lines:
            self.append(line)

    def frame(self) -> pd.DataFrame:
        """Every line, oldest first, as a DataFrame with the Line fields as columns."""
        df = pd.read_sql_query("SELECT * FROM lines ORDER BY seq", self.db)
        if "checkpointing" in df:
            df["checkpointing"] = df["checkpointing"].astype(bool)
        check_versions(df, self.path)
        return df

    def standing_lines(self, config_key: str) -> list[Line]:
        """The lines of the newest run that decides a configuration's state: a finished run, else a failed one."""
        cur = self.db.execute("SELECT * FROM lines WHERE config_key = ? ORDER BY seq", (config_key,))
        names = [d[0] for d in cur.description]
        runs: dict[str, list[Line]] = {}
        for row in cur.fetchall():
            rec = {k: v for k, v in zip(names, row) if k in LINE_FIELDS}
            rec["checkpointing"] = bool(rec["checkpointing"])
            line = Line(**rec)
            runs.setdefault(line.run_id, []).append(line)
        states = {rid: run_state([(ln.phase, ln.verdict) for ln in lines]) for rid, lines in runs.items()}
        want = "done" if "done" in states.values() else "failed"
        decided = [rid for rid, state in states.items() if state == want]
        return runs[decided[-1]] if decided else []

    def run_status(self) -> dict[str, dict]:
        """config_key -> {'state': done|failed|incomplete, 'runs': [...]}, from the newest attempt."""
        rows = self.db.execute("SELECT config_key, run_id, phase, verdict FROM lines ORDER BY seq").fetchall()
        runs: dict[str, dict[str, list[tuple[str, str]]]] = {}
        for key, run_id, phase, verdict in rows:
            runs.setdefault(key, {}).setdefault(run_id, []).append((phase, verdict))
        status = {}
        for key, by_run in runs.items():
            states = [run_state(lines) for lines in by_run.values()]
            state = "done" if "done" in states else ("failed" if "failed" in states else "incomplete")
            status[key] = {"state": state, "runs": list(by_run)}
        return status


CLAIM_STALE_S = 600.0  # a claim not refreshed for this long is abandoned, whoever holds its pid now
HEARTBEAT_S = 60.0  # how often a holder refreshes its claim


def _alive(pid: int | None, host: str | None, heartbeat: float | None) -> bool:
    """A claim stands while its heartbeat is fresh; on this host, also only while its process exists. A stale
    heartbeat ends it whatever the pid: a pid is reused, so a live process of that number proves nothing."""
    if heartbeat is None or time.time() - float(heartbeat) >= CLAIM_STALE_S:
        return False
    if host == socket.gethostname():
        if not pid:
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


@contextlib.contextmanager
def holding(path, key: str, run_id: str, every_s: float = HEARTBEAT_S):
    """Refresh a claim while its work runs (a thread with its own connection: SQLite handles are per thread)."""
    import threading

    stop = threading.Event()

    def beat():
        with Ledger(path) as own:
            while not stop.wait(every_s):
                own.heartbeat(key, run_id)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def _backup(path: Path, version: int) -> Path:
    """Copy an older ledger aside before migrating it (SQLite's backup API: consistent even in WAL mode)."""
    dest = path.with_name(f"{path.name}.schema{version}.bak")
    n = 1
    while dest.exists():
        dest, n = path.with_name(f"{path.name}.schema{version}.{n}.bak"), n + 1
    src = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        out = sqlite3.connect(str(dest))
        with out:
            src.backup(out)
        out.close()
    finally:
        src.close()
    return dest


def run_state(lines: list[tuple[str, str]]) -> str:
    """done: every phase ended ok; failed: a phase ended in a failure verdict; else incomplete."""
    verdicts = {v for _, v in lines}
    if Verdict.INTERRUPTED.value in verdicts:
        return "incomplete"
    if verdicts & {v.value for v in FAILED}:
        return "failed"
    phases_ok = {p for p, v in lines if v == Verdict.OK.value}
    if all(p in phases_ok for p in PHASES):
        return "done"
    return "incomplete"


# torch and CUDA versions as torch reports them ("2.13.0+cpu", "2.6.0.dev20241112+cu124", "12.4"): they reach
# order.json and sky.yaml's pip line, so a ledger value that is anything else is refused where it is read.
VERSION = re.compile(r"\d+(\.\d+){1,3}[A-Za-z0-9.+_-]{0,64}")


def check_versions(df: pd.DataFrame, source) -> None:
    for col in ("torch_version", "cuda_version"):
        if col not in df:
            continue
        values = df[col].dropna().astype(str)
        bad = values[~values.map(lambda v: v == "" or bool(VERSION.fullmatch(v)))]  # "": not known (a lost worker)
        if len(bad):
            i = bad.index[0]
            run = df.loc[i, "run_id"] if "run_id" in df else "?"
            raise LedgerError(f"{source}: line {i + 1} (run {run}) has {col} {bad.iloc[0][:80]!r}, which is not a "
                              "version as torch reports one: the ledger was edited outside rentplan. Probe again "
                              "into a new ledger (--ledger NEW.db).")


def lines_frame(lines: Iterable[Line]) -> pd.DataFrame:
    """Lines as a frame like the ledger's (the Line fields as columns)."""
    return pd.DataFrame([ln.to_dict() for ln in lines], columns=list(LINE_FIELDS))


def read_lines(path: str | Path) -> pd.DataFrame:
    with Ledger(path, create=False) as led:
        return led.frame()


def export_frame(df: pd.DataFrame, path: Path, fmt: str) -> None:
    """CSV or JSONL, unknown values as empty / null (never NaN)."""
    clean = df.astype(object).where(pd.notna(df), None)
    if fmt == "csv":
        text = clean.to_csv(index=False)
    elif fmt == "jsonl":
        text = "".join(json.dumps(rec) + "\n" for rec in clean.to_dict(orient="records"))
    else:
        raise LedgerError(f"unknown export format {fmt!r}: use csv or jsonl.")
    with made_or_nothing(path.parent):
        atomic_write(path, text)


__all__ = ["Ledger", "LINE_FIELDS", "new_id", "read_lines", "export_frame", "run_state"]
