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
import sysconfig
import zlib
from pathlib import Path
from typing import Any

from planner.errors import WorkloadError

REQUIRED = ("name", "build_model", "make_batch", "compute_loss")
OWN_PACKAGES = {"planner", "probes"}


def _builtin(name: str):
    from probes.builtin import BUILTINS

    if name not in BUILTINS:
        raise WorkloadError(f"unknown built-in workload {name!r}. Built-ins: {', '.join(sorted(BUILTINS))}.")
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
        raise WorkloadError(f"workload file {target} not found (from {ref!r}).")
    mod_name = f"rentplan_workload_{zlib.crc32(str(path.resolve()).encode())}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
    _run_import(lambda: spec.loader.exec_module(module), target)
    return module


def _import_module(target: str, ref: str):
    top = target.split(".")[0]
    if top in sys.stdlib_module_names:
        raise WorkloadError(f"workload {ref!r} names the standard library module {target!r}: a workload must be a "
                            "function or class in your own file or module.")
    if top in OWN_PACKAGES:
        raise WorkloadError(f"workload {ref!r} names rentplan's own module {target!r}; use builtin:gpt, "
                            "builtin:classifier, or your own file or module.")
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


def _installed(origin: str) -> bool:
    """Under site-packages / dist-packages or the interpreter's own library: someone else's code."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    real = os.path.realpath(origin)
    return any(real.startswith(os.path.realpath(p) + os.sep) for p in paths) or \
        any(part in ("site-packages", "dist-packages") for part in Path(real).parts)


def _run_import(load, target: str):
    try:
        return load() or sys.modules.get(target)
    except SystemExit as e:
        raise WorkloadError(f"importing {target} called sys.exit({e.code}); a workload file must be importable "
                            "without running anything (put scripts under `if __name__ == '__main__':`).") from None
    except Exception as e:
        raise WorkloadError(f"importing {target} failed: {type(e).__name__}: {e}") from e


def _own_callable(module, func: str, target: str, ref: str):
    """The named function or class, checked before anything calls it: defined in that very file or module
    (not imported into it), and Python code (not a builtin or C function)."""
    if not hasattr(module, func):
        raise WorkloadError(f"{target} has no function {func!r} (from {ref!r}).")
    obj = getattr(module, func)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        raise WorkloadError(f"{target}:{func} is a {type(obj).__name__}, not a Python function or class "
                            f"(from {ref!r}).")
    if getattr(obj, "__module__", None) != module.__name__:
        raise WorkloadError(f"{target}:{func} is not defined in {target}: it comes from "
                            f"{getattr(obj, '__module__', '?')}. Name the function where it is written.")
    return obj


def describe_workload(ref: str) -> str:
    """What a reference will import and call, resolved under the same rules as load_workload, without calling
    anything of the workload's (its module is imported: that is how Python finds the function)."""
    if ref.startswith(("builtin:", "hf:")):
        return f"{ref} (rentplan's own loader)"
    obj = _factory(ref)
    try:
        line = inspect.getsourcelines(obj)[1]
        where = f"{inspect.getsourcefile(obj)}, line {line}"
    except (OSError, TypeError):
        where = getattr(obj, "__module__", "?")
    return f"{'class' if inspect.isclass(obj) else 'function'} {obj.__qualname__} in {where}"


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
    return obj


def _signature(factory) -> str:
    try:
        return str(inspect.signature(factory))
    except (TypeError, ValueError):
        return "(unknown)"


def count_targets(workload, batch: dict) -> int:
    if hasattr(workload, "count_targets"):
        return int(workload.count_targets(batch))
    first = next(iter(batch.values()))
    return int(first.shape[0])
