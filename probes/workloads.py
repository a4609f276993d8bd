"""Resolve a workload reference to an object that obeys the workload contract (see README).

References: `builtin:gpt`, `builtin:classifier`, `path/to/file.py:function`, `package.module:function`.
The function is called with the --param pairs; bad references fail as WorkloadError with what to fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import zlib
from pathlib import Path
from typing import Any

from planner.errors import WorkloadError
from planner.inputs.modules import OWN_PACKAGES, _installed, local_modules  # noqa: F401  (re-exported)

REQUIRED = ("name", "build_model", "make_batch", "compute_loss")


def _builtin(name: str):
    from probes.builtin import BUILTINS

    if name not in BUILTINS:
        import difflib

        hint = difflib.get_close_matches(name, list(BUILTINS), n=1)
        raise WorkloadError(f"unknown built-in workload {name!r}" + (f" (did you mean builtin:{hint[0]}?)" if hint
                            else "") + f". Built-ins: {', '.join(sorted(BUILTINS))}.")
    return BUILTINS[name]


def _factory(ref: str):
    if ref.startswith("builtin:"):
        return _builtin(ref.split(":", 1)[1])
    if ref.startswith("hf:"):
        from probes.hf import hf_workload

        path = ref.split(":", 1)[1]
        return lambda **params: hf_workload(path, **params)
    if ":" not in ref:
        raise WorkloadError(f"workload {ref!r} is not a reference. Use builtin:gpt, path/file.py:function "
                            "or package.module:function.")
    target, func = ref.rsplit(":", 1)
    if target.endswith(".py") or "/" in target or os.sep in target:
        module = _import_file(target, ref)
    else:
        module = _import_module(target, ref)
    return _own_callable(module, func, target, ref)


def _import_file(target: str, ref: str):
    path = Path(target)
    if path.suffix != ".py":
        raise WorkloadError(f"workload file {target} is not a .py file (from {ref!r}); name your workload as "
                            "path/to/file.py:function.")
    if not path.is_file():
        import difflib

        folder = path.parent if str(path.parent) else Path(".")
        near = difflib.get_close_matches(path.name, [p.name for p in folder.glob("*.py")], n=1) \
            if folder.is_dir() else []
        raise WorkloadError(f"workload file {target} not found (from {ref!r})" + (
            f": did you mean {folder / near[0]}?" if near else ". Pass -w path/to/file.py:function (a path from "
                                                               "the folder you run in)."))
    mod_name = f"rentplan_workload_{zlib.crc32(str(path.resolve()).encode())}"
    # As `python file.py` does: the file's folder first on sys.path, so its own modules import. Every process
    # that loads the workload (the command, each worker, each rank) comes through here, so each gets it.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
    _run_import(lambda: spec.loader.exec_module(module), target)
    return module


def _refuse_foreign(target: str, ref: str) -> None:
    top = target.split(".")[0]
    if top in sys.stdlib_module_names:
        raise WorkloadError(f"workload {ref!r} names the standard library module {target!r}: a workload must be a "
                            "function or class in your own file or module.")
    if top in OWN_PACKAGES:
        raise WorkloadError(f"workload {ref!r} names rentplan's own module {target!r}; use builtin:gpt, "
                            "builtin:classifier, or your own file or module.")


def _import_module(target: str, ref: str):
    _refuse_foreign(target, ref)
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError) as e:
        raise WorkloadError(f"cannot find module {target!r} (from {ref!r}): {e}") from None
    if found is None or not found.origin:
        raise WorkloadError(f"cannot find module {target!r} (from {ref!r}); is it on PYTHONPATH?")
    if _installed(found.origin):
        raise WorkloadError(f"workload {ref!r} names {target!r}, an installed package ({found.origin}): a workload "
                            "must be a function or class in your own file or module, not a library's.")
    return _run_import(lambda: importlib.import_module(target), target)


class _ExitAtImport(BaseException):
    """os._exit called while a workload file was being imported (it would end rentplan without a word)."""


class _ForkAtImport(BaseException):
    """os.fork called while a workload file was being imported (its child would outlive rentplan)."""


def _exit_at_import(code: int = 0):
    raise _ExitAtImport(code)


def _fork_at_import(*args, **kwargs):
    raise _ForkAtImport()


_GUARDED = {"_exit": _exit_at_import, "fork": _fork_at_import, "forkpty": _fork_at_import}


def _run_import(load, target: str):
    # A top-level os._exit would end this process at once, and a top-level os.fork would leave a child that
    # outlives the command (holding multiprocessing's forkserver open): for the import, both raise instead.
    real = {name: getattr(os, name) for name in _GUARDED if hasattr(os, name)}
    for name in real:
        setattr(os, name, _GUARDED[name])
    try:
        return load() or sys.modules.get(target)
    except _ExitAtImport as e:
        sys.modules.pop(target, None)
        raise WorkloadError(f"importing {target} called os._exit({e.args[0]}); a workload file must be importable "
                            "without running anything (put scripts under `if __name__ == '__main__':`).") from None
    except _ForkAtImport:
        sys.modules.pop(target, None)
        raise WorkloadError(f"importing {target} called os.fork(); a workload file must be importable without "
                            "starting processes (start them in make_batch or a DataLoader, or put scripts under "
                            "`if __name__ == '__main__':`).") from None
    except SystemExit as e:
        raise WorkloadError(f"importing {target} called sys.exit({e.code}); a workload file must be importable "
                            "without running anything (put scripts under `if __name__ == '__main__':`).") from None
    except Exception as e:
        raise WorkloadError(f"importing {target} failed: {type(e).__name__}: {e}") from e
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


def _own_callable(module, func: str, target: str, ref: str):
    """The named function or class, checked before anything calls it: defined in that very file or module
    (not imported into it), and Python code (not a builtin or C function)."""
    if not hasattr(module, func):
        import difflib

        names = [n for n, o in vars(module).items() if (inspect.isfunction(o) or inspect.isclass(o))
                 and getattr(o, "__module__", None) == module.__name__]
        hint = difflib.get_close_matches(func, names, n=1)
        raise WorkloadError(f"{target} has no function {func!r} (from {ref!r})."
                            + (f" Did you mean {hint[0]!r}?" if hint else
                               f" It defines: {', '.join(sorted(names)[:8]) or 'no function'}."))
    obj = getattr(module, func)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        raise WorkloadError(f"{target}:{func} is a {type(obj).__name__}, not a Python function or class "
                            f"(from {ref!r}).")
    if getattr(obj, "__module__", None) != module.__name__:
        raise WorkloadError(f"{target}:{func} is not defined in {target}: it comes from "
                            f"{getattr(obj, '__module__', '?')}. Name the function where it is written.")
    return obj


OWN_LOOPS = ("trainer:", "lightning:", "script:")


def locate_workload(ref: str) -> str:
    """Where a reference's function is, found by reading files, never by importing them: what `verify` says
    before its pilot imports anything. The same rules as load_workload (a function or class defined in the
    user's own file or module)."""
    if ref.startswith(OWN_LOOPS):
        return f"{ref}: your own loop (measured by a callback or probe --script); rentplan imports nothing of it"
    if ref.startswith("builtin:"):
        _builtin(ref.split(":", 1)[1])
        return f"{ref} (rentplan's own)"
    if ref.startswith("hf:"):
        path = Path(ref[3:])
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise WorkloadError(f"{ref}: no config.json at {config}.")
        return f"{ref} (rentplan's own loader of {config})"
    if ":" not in ref:
        raise WorkloadError(f"workload {ref!r} is not a reference. Use builtin:gpt, path/file.py:function "
                            "or package.module:function.")
    target, func = ref.rsplit(":", 1)
    if target.endswith(".py") or "/" in target or os.sep in target:
        if Path(target).suffix != ".py":
            raise WorkloadError(f"workload file {target} is not a .py file (from {ref!r}).")
        origin = target
    else:
        origin = _module_file(target, ref)
    if not Path(origin).is_file():
        raise WorkloadError(f"workload file {origin} not found (from {ref!r}).")
    line = _top_level_definition(origin, func, ref)
    return f"will import {func} (line {line} of {origin}) when the pilot runs; not imported by this check"


def _module_file(target: str, ref: str) -> str:
    """The file of package.module, found the way import would find it (sys.path, then each package's own
    folders) without running any package's __init__."""
    from importlib.machinery import PathFinder

    _refuse_foreign(target, ref)
    parts, search, spec = target.split("."), None, None
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is None:
            raise WorkloadError(f"cannot find module {target!r} (from {ref!r}); is it on PYTHONPATH?")
        search = spec.submodule_search_locations
    if not spec.origin or not spec.origin.endswith(".py"):
        raise WorkloadError(f"module {target!r} (from {ref!r}) is not a Python source file.")
    if _installed(spec.origin):
        raise WorkloadError(f"workload {ref!r} names {target!r}, an installed package ({spec.origin}): a workload "
                            "must be a function or class in your own file or module, not a library's.")
    return spec.origin


def _top_level_definition(origin: str, func: str, ref: str) -> int:
    import ast

    try:
        tree = ast.parse(Path(origin).read_bytes(), filename=origin)
    except (SyntaxError, ValueError, OSError) as e:
        raise WorkloadError(f"cannot read {origin} as Python (from {ref!r}): {e}") from None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == func:
            return node.lineno
    import difflib

    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    hint = difflib.get_close_matches(func, names, n=1)
    raise WorkloadError(f"{origin} defines no function or class {func!r} at its top level (from {ref!r})"
                        + (f": did you mean {hint[0]!r}?" if hint else ": name the function where it is written."))


def load_workload(ref: str, params: dict[str, Any] | None = None):
    """Call the workload's factory with params and check the returned object against the contract."""
    factory = _factory(ref)
    params = params or {}
    try:
        obj = factory(**params)
    except WorkloadError:
        raise
    except TypeError as e:
        sig = _signature(factory)
        raise WorkloadError(f"workload {ref!r} does not take these params ({e}). It accepts: {sig}.") from e
    except Exception as e:
        raise WorkloadError(f"workload {ref!r} raised {type(e).__name__}: {e}") from e
    missing = [m for m in REQUIRED if not hasattr(obj, m)]
    not_callable = [m for m in REQUIRED[1:] if hasattr(obj, m) and not callable(getattr(obj, m))]
    if missing or not_callable:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing))
        if not_callable:
            parts.append("not callable: " + ", ".join(not_callable))
        raise WorkloadError(f"workload {ref!r} returned an object that does not obey the contract "
                            f"({'; '.join(parts)}). See the README, 'The workload contract'.")
    fmt = getattr(obj, "memory_format", "contiguous")
    if fmt not in MEMORY_FORMATS:
        raise WorkloadError(f"workload {ref!r} states memory_format {fmt!r}: it must be one of "
                            f"{', '.join(MEMORY_FORMATS)}. See the README, 'The workload contract'.")
    return obj


# A workload's optional `memory_format`: the layout the harness gives its model and its 4-D float inputs
# (probes/loop.Trainer). cuDNN runs tensor-core convolutions in NHWC; NCHW tensors are transposed around them,
# which costs time (planner/models/roofline.py, conv_fraction).
MEMORY_FORMATS = ("contiguous", "channels_last")


def _signature(factory) -> str:
    try:
        return str(inspect.signature(factory))
    except (TypeError, ValueError):
        return "(unknown)"
