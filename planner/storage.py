"""Whether a folder can take a write, said in words before a command starts writing (a full disk or a read-only
folder is named as such, not blamed on the file being read)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

FULL_BELOW_BYTES = 1 << 20  # less than this free is a full disk for a ledger line or a checkpoint


def nearest_existing(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists (where a new folder would be made)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def storage_problem(folder: Path) -> str:
    """Why `folder` (or, when it does not exist yet, the folder it would be made in) cannot take a write: a
    read-only file system or folder, or a full disk; "" when the file system says it can."""
    folder = nearest_existing(folder)
    if folder.is_file():
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return ""
    if st.f_flag & os.ST_RDONLY:
        return f"the folder {folder} is on a read-only file system"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is read-only for this user"
    free = st.f_bavail * st.f_frsize
    if free < FULL_BELOW_BYTES:
        return f"the disk holding {folder} is full ({free:,} bytes free)"
    return ""


class WriteError(OSError):
    """A write that failed, naming the file being written (an OSError's filename may be the file read: shutil's
    copy names its source on ENOSPC)."""


def atomic_write(path: Path, text: str | bytes) -> None:
    """`text` replaces `path` in one step, or nothing changes: a failed write (full disk, read-only folder) removes
    its temporary file and says which file it was writing."""
    write_all({Path(path): text})


def write_all(files: dict[Path, str | bytes | None]) -> None:
    """Every file replaced, or none: each is written whole beside its target first (a full disk fails here, and
    the temporary files go), then all are moved into place; None removes a file. So a plan that fails half way
    leaves no mix of an old order.json and a new selection.csv."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, text in files.items():
            if path.is_dir():  # os.replace cannot put a file there: refused before any file is moved
                raise WriteError(errno.EISDIR, "is a folder, where this file goes", str(path))
            if text is None:
                continue
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
                staged.append((tmp, path))
                with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
            except OSError as e:
                if e.errno is None:
                    raise
                raise WriteError(e.errno, e.strerror, str(path)) from None  # the file asked for, not its temporary
        for i, (tmp, path) in enumerate(staged):
            try:
                os.replace(tmp, path)
            except OSError as e:
                staged = staged[i:]  # the moved ones are in place; the rest go with their temporaries
                raise WriteError(e.errno or errno.EIO, e.strerror or str(e), str(path)) from None
        staged = []
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        raise
    for path, text in files.items():
        if text is None:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def made_or_nothing(folder: Path):
    """A folder the command makes for its outputs goes again when the command fails: everything in it is the
    command's own, half written. A folder that existed before is left as it is (its files are replaced whole)."""
    folder = Path(folder).absolute()
    there = nearest_existing(folder)
    first_new = next((p for p in [folder, *folder.parents] if p.parent == there), None) if folder != there else None
    try:
        yield
    except BaseException:
        if first_new is not None and first_new.is_dir():
            shutil.rmtree(first_new, ignore_errors=True)
        raise


def advice(reason: str) -> str:
    """What to do about a storage_problem: a full disk wants space, a read-only one another place."""
    return "free space there, or write elsewhere" if "full" in reason else "write elsewhere"
