"""The user's own modules a workload file imports (what travels with it to an archive or a rented machine), found
by reading files, never by importing them. Torch-free: the planner's launch layout and the probes' archive share it."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

OWN_PACKAGES = {"planner", "probes"}


def local_modules(source: str | Path) -> list[Path]:
    """The workload file and every module it imports, directly or through each other, from files under its
    folder (what travels with it: the modules beside it, their packages), found by reading the files (modulefinder
    on that folder alone, so nothing is imported and torch's own files are never read); the file first."""
    import modulefinder

    src = Path(source).resolve()
    folder = src.parent
    finder = modulefinder.ModuleFinder(path=[str(folder)])
    try:
        finder.run_script(str(src))
    except (SyntaxError, ImportError, OSError, ValueError):
        return [src]  # unreadable as Python: the file itself is what there is
    # rentplan's own code is not the user's
    found = {Path(file).resolve() for name, m in finder.modules.items()
             if (file := getattr(m, "__file__", None)) and name.split(".")[0] not in OWN_PACKAGES}
    found = {p for p in found if p.suffix == ".py" and p.is_relative_to(folder) and not _installed(str(p))}
    return [src] + sorted(found - {src})


def _installed(origin: str) -> bool:
    """Under site-packages / dist-packages or the interpreter's own library: someone else's code."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    real = os.path.realpath(origin)
    return any(real.startswith(os.path.realpath(p) + os.sep) for p in paths) or \
        any(part in ("site-packages", "dist-packages") for part in Path(real).parts)
