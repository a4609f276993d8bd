"""Whether a folder can take a write, said in words before a command starts writing (a full disk or a read-only
folder is named as such, not blamed on the file being read)."""

from __future__ import annotations

import os
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
