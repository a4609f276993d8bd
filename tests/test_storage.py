"""A full disk or a read-only folder is said as such, and the failing command leaves the folder as it found it
(issue 28). The disks are real: a small tmpfs, filled or remounted read-only (root only; skipped elsewhere)."""

import errno
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.factories import campaign_yaml, standard_ledger
from tests.test_failed_commands_write_nothing import listing

PROBE = ["probe", "-w", "builtin:gpt", "-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64",
         "--micro-batch", "1", "--seq-len", "8"]


def mount_tmpfs(where, size="1m"):
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}): run as root")


@pytest.fixture
def disk(tmp_path):
    where = tmp_path / "disk"
    mount_tmpfs(where)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk):
    with open(disk / "fill", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def run(args):
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert "Traceback" not in r.output and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    return r


def test_a_ledger_on_a_full_disk_is_said_full_and_leaves_no_sqlite_files(disk, tmp_path):
    standard_ledger(disk / "l.db")
    fill(disk)
    before = listing(disk)
    for ledger in ("l.db", "new.db"):
        r = run([*PROBE, "--ledger", disk / ledger])
        assert r.exit_code == 1 and "is full" in r.output and "not a rentplan ledger" not in r.output, r.output
    assert listing(disk) == before  # no -wal, no torn -shm, no empty new.db
    r = run(["plan", "--campaign", "planner/examples/lr-comparison.yaml", "--ledger", disk / "l.db",
             "--out", tmp_path / "out"])  # reading needs no space: the plan's own error is about the lines
    assert "is full" not in r.output and listing(disk) == before


def test_a_ledger_in_a_read_only_folder_is_said_read_only(disk):
    standard_ledger(disk / "l.db")
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    before = listing(disk)
    r = run([*PROBE, "--ledger", disk / "l.db"])
    assert r.exit_code == 1 and "read-only file system" in r.output, r.output
    r = run(["ledger", "show", "--ledger", disk / "l.db"])  # reading still works
    assert r.exit_code == 0 and "steady" in r.output, r.output
    assert listing(disk) == before


def test_campaign_run_onto_a_full_disk_blames_the_disk_and_makes_no_folder(disk, tmp_path):
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    fill(disk)
    before = listing(disk), listing(tmp_path / "disk")
    r = run(["campaign", "run", tmp_path / "c.yaml", "--ledger", tmp_path / "new.db", "--out", disk / "runs"])
    assert r.exit_code == 1 and "is full" in r.output and "c.yaml" not in r.output, r.output
    assert (listing(disk), listing(tmp_path / "disk")) == before
    assert not (tmp_path / "new.db").exists()  # refused before the ledger was made


def test_a_disk_that_fills_while_the_run_folder_is_made_leaves_no_half_folder(tmp_path, monkeypatch):
    """The preflight passes, then the disk fills while the spec is copied into the run's folder (before: a 0-byte
    spec/c.yaml under a new runs/c-*/ and an Error blaming the spec's path)."""
    (tmp_path / "c.yaml").write_text(campaign_yaml())

    def full(src, dst, **kw):
        open(dst, "wb").close()
        raise OSError(errno.ENOSPC, "No space left on device", str(src))
    monkeypatch.setattr(shutil, "copy2", full)
    r = run(["campaign", "run", tmp_path / "c.yaml", "--ledger", tmp_path / "l.db", "--out", tmp_path / "runs"])
    assert r.exit_code == 1 and "No space left on device while writing" in r.output, r.output
    assert "c.yaml" not in r.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a campaign run
def test_a_checkpoint_that_fills_the_disk_says_so_and_leaves_no_temporary_file(tmp_path):
    """User: a campaign whose --out disk fills during a checkpoint save read 'RuntimeError: [enforce fail at
    inline_container.cc:672]' with no word of the disk, and left a 2.2 MB checkpoint-...pt.tmp-PID behind."""
    where = tmp_path / "disk"
    mount_tmpfs(where, size="4m")  # the spec, logs and reference fit; a 1.6M-parameter model's checkpoint does not
    try:
        (tmp_path / "c.yaml").write_text(campaign_yaml(
            params={"layers": 2, "d_model": 256}, seq_len=32, updates=4, effective_batch=2, save_every_updates=2,
            eval={"every_updates": 2, "examples": 2, "seq_len": 32}, variants=[{"id": "a", "lr": 1e-4}]))
        r = run(["campaign", "run", tmp_path / "c.yaml", "--ledger", tmp_path / "l.db", "--out", where / "runs"])
        assert "enforce fail" not in r.output and "the disk holding" in r.output and "is full" in r.output, r.output
        assert not [p for p in where.rglob("*") if ".tmp-" in p.name]
        shown = run(["campaign", "report", tmp_path / "c.yaml", "--ledger", tmp_path / "l.db", "--out",
                     tmp_path / "rep"])
        assert "is full" in shown.output or "error" in shown.output, shown.output
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow  # a campaign run
def test_an_archive_that_fills_the_disk_leaves_no_half_archive(tmp_path):
    """`archive RUN --to DIR` onto a disk too small for the weights: the folder it made goes again."""
    (tmp_path / "c.yaml").write_text(campaign_yaml(
        params={"layers": 2, "d_model": 256}, seq_len=32, updates=2, effective_batch=2,
        eval={"every_updates": 2, "examples": 2, "seq_len": 32}, variants=[{"id": "a", "lr": 1e-4}]))
    r = run(["campaign", "run", tmp_path / "c.yaml", "--ledger", tmp_path / "l.db", "--out", tmp_path / "runs"])
    assert r.exit_code == 0, r.output
    run_id = next((tmp_path / "runs").iterdir()).name
    where = tmp_path / "disk"
    mount_tmpfs(where, size="1m")
    try:
        r = run(["archive", run_id, "--to", where / "arch", "--ledger", tmp_path / "l.db", "--out", tmp_path / "runs"])
        assert r.exit_code == 1 and "No space left on device" in r.output, r.output
        assert list(where.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow  # a campaign run
def test_a_ledger_disk_that_fills_during_a_campaign_run_is_said_without_a_traceback(tmp_path):
    """A helper's attack: `campaign run --ledger M/c.db` on a 160 KB tmpfs filled mid-run: two chained sqlite
    tracebacks ('database or disk is full'), exit 1."""
    where = tmp_path / "disk"
    mount_tmpfs(where, size="160k")
    try:
        (tmp_path / "c.yaml").write_text(campaign_yaml(updates=4000, effective_batch=2, save_every_updates=4000,
                                                       eval={"every_updates": 4000, "examples": 2, "seq_len": 16},
                                                       seq_len=16, variants=[{"id": "a", "lr": 1e-4}]))
        r = run(["campaign", "run", tmp_path / "c.yaml", "--ledger", where / "c.db", "--out", tmp_path / "runs"])
        assert r.exit_code == 1 and "cannot take another row" in r.output and "is full" in r.output, r.output
        assert "kept" in r.output
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_plan_that_fills_the_disk_leaves_the_earlier_plan_as_it_was(disk, tmp_path):
    """A helper's attack: `plan --out` into a folder holding an earlier plan, on a disk that fills half way, left
    the old order.json beside a new selection.csv."""
    (disk / "po").mkdir()
    (disk / "po" / "order.json").write_text("OLD")
    (disk / "po" / "selection.csv").write_text("OLDSEL")
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    fill(disk)
    with open(disk / "fill", "r+b") as f:  # room for the first files of the plan, not for all of them
        f.truncate(f.seek(0, 2) - 250_000)  # selection.csv, plans.csv and the md sheet fit; the html does not
    before = listing(disk)
    r = run(["plan", "--campaign", tmp_path / "c.yaml", "--ledger", standard_ledger(tmp_path / "l.db"),
             "--out", disk / "po"])
    assert r.exit_code == 1 and "No space left on device while writing" in r.output, r.output
    files = lambda rows: [row for row in rows if row[1] >= 0]  # noqa: E731  (a folder's mtime moves with its temporaries)
    assert files(listing(disk)) == files(before)
    assert (disk / "po" / "order.json").read_text() == "OLD"


@pytest.mark.parametrize("blocker", ["order.json", pytest.param("sky.yaml", marks=pytest.mark.slow)])
def test_a_plan_whose_output_name_is_a_folder_replaces_nothing_and_leaves_no_temporaries(tmp_path, blocker):
    """A fresh-clone user (#46's attack): with `out/order.json` a folder, `plan --out out` said
    "out/.order.json.y8onpcvs.tmp: is a folder" (a file the user never named), had already replaced selection.csv,
    plans.csv and the sheets, and left .order.json.*.tmp and .sky.yaml.*.tmp behind at every try. Every target is
    checked before anything is moved: the error names it, nothing is replaced and no temporary stays."""
    out = tmp_path / "out"
    (out / blocker).mkdir(parents=True)
    (out / "selection.csv").write_text("OLD")
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    r = run(["plan", "--campaign", tmp_path / "c.yaml", "--ledger", standard_ledger(tmp_path / "l.db"),
             "--out", out])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"{out / blocker}" in r.output and ".tmp" not in r.output, r.output
    assert (out / "selection.csv").read_text() == "OLD"
    assert sorted(p.name for p in out.iterdir()) == sorted([blocker, "selection.csv"])
