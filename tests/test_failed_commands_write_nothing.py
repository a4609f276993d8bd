"""A command that fails writes nothing (issue 28): for each failing command of the attack list, a listing of the
folder it ran in (every path, its size and modification time) is the same before and after, and the command
ended with `Error:` and a non-zero status, never a traceback."""

import sqlite3

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.factories import campaign_yaml, standard_ledger


def listing(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
                  for p in root.rglob("*"))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    standard_ledger(tmp_path / "l.db")
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    (tmp_path / "bad-catalog.yaml").write_text("gpus: 5\noffers: []\n")
    (tmp_path / "vms.csv").write_text("not,a,skypilot,csv\n1,2,3,4\n")
    (tmp_path / "order.json").write_text('{"schema": "nope"}')
    (tmp_path / "data.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    db = sqlite3.connect(tmp_path / "foreign.db")
    db.execute("CREATE TABLE t (x)")
    db.commit()
    db.close()
    return tmp_path


FAILING = [
    ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--catalog", "bad-catalog.yaml", "--out", "out"],
    ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--offer", "no-such-offer", "--out", "out"],
    ["plan", "--campaign", "c.yaml", "--ledger", "missing.db", "--out", "out"],
    ["plan", "--campaign", "broken.yaml", "--ledger", "l.db", "--out", "out"],
    ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--all-offers"],
    ["plan", "--campaign", "c.yaml", "--ledger", "foreign.db", "--out", "out"],
    ["campaign", "run", "broken.yaml", "--ledger", "new.db", "--out", "runs"],
    ["campaign", "run", "c.yaml", "--ledger", "foreign.db", "--out", "runs"],
    ["campaign", "run", "c.yaml", "--variant", "no-such-variant", "--ledger", "new.db", "--out", "runs"],
    ["campaign", "run", "c.yaml", "--seeds", "a,b", "--ledger", "new.db", "--out", "runs"],
    ["campaign", "report", "c.yaml", "--ledger", "l.db", "--out", "report"],
    ["campaign", "finish", "c-0000000000", "--ledger", "l.db", "--out", "runs"],
    ["probe", "--micro-batch", "0", "--ledger", "new.db"],
    ["probe", "-w", "nowhere.py:make", "--ledger", "new.db"],
    ["estimate", "-w", "builtin:no-such", "--ledger", "new.db"],
    ["catalog", "import", "--skypilot", "vms.csv", "--provider", "x", "--as-of", "2026-12-01", "--out", "cat.yaml"],
    ["catalog", "validate", "bad-catalog.yaml"],
    ["archive", "c-0000000000", "--to", "arch", "--ledger", "l.db"],
    ["archive", "verify", "no-such-folder"],
    ["verify", "order.json", "--skip-pilot"],
    ["split", "data.jsonl", "--ratios", "0.5,0.7", "--out", "splits"],
    ["ledger", "export", "--ledger", "missing.db", "--to", "lines.csv"],
    ["ledger", "show", "--ledger", "foreign.db"],
    ["batch", "--micro-batch", "2", "--grad-accum", "2", "--compare", "micro=abc"],
]


@pytest.mark.parametrize("args", FAILING, ids=[" ".join(a[:3]) for a in FAILING])
def test_a_failing_command_leaves_the_folder_as_it_found_it(folder, args):
    before = listing(folder)
    r = CliRunner().invoke(cli, args)
    assert r.exit_code != 0, r.output
    assert "Error:" in r.output and "Traceback" not in r.output, r.output
    assert listing(folder) == before, r.output


FULL = (28, "No space left on device")  # errno.ENOSPC
READ_ONLY = (30, "Read-only file system")  # errno.EROFS


@pytest.mark.parametrize("fault, says", [
    (FULL, ["No space left on device", "new/deeper/", "free space on that disk or write elsewhere"]),
    (READ_ONLY, ["new/deeper/", "is on a read-only file system: write elsewhere"]),
])
@pytest.mark.parametrize("args", [
    ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "new/deeper"],
    ["ledger", "export", "--ledger", "l.db", "--to", "new/deeper/lines.csv"],
], ids=["plan --out", "ledger export --to"])
def test_a_full_or_read_only_disk_is_named_with_the_file_and_leaves_no_folder(folder, monkeypatch, args, fault,
                                                                            says):
    """User: `plan --out` onto a full disk errored but left an empty output folder; into a read-only folder it said
    "Read-only file system while writing. Free space on that disk", with no path and the wrong advice. The disk
    fails where a real one does: at the file's creation (read-only) or its flush (full)."""
    import os
    import tempfile

    before = listing(folder)
    if fault == READ_ONLY:
        def refuse(*a, dir=None, **k):
            raise OSError(*fault, os.path.join(dir or ".", "x.tmp"))
        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    else:
        monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(*fault)))
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1 and r.output.startswith("Error: ") and "Traceback" not in r.output, r.output
    for s in says:
        assert s in r.output, r.output
    assert "Free space on that disk" not in r.output or fault == FULL
    assert listing(folder) == before, r.output
