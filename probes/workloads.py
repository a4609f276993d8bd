"""Resolve a workload reference to an object that obeys the workload contract (see README).

References: `builtin:gpt`, `builtin:classifier`, `path/to/file.py:function`, `package.module:function`.
The function is called with the --param pairs; bad references fail as WorkloadError with what to fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from planner.errors import WorkloadError

REQUIRED = ("name", "build_model", "make_batch", "compute_loss")
OPTIONAL = ("count_targets", "predict", "show", "class_names")


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
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise WorkloadError(f"workload file {target} not found (from {ref!r}).")
        mod_name = f"rentplan_workload_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise WorkloadError(f"importing {target} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise WorkloadError(f"cannot import module {target!r} (from {ref!r}): {type(e).__name__}: {e}") from e
    if not hasattr(module, func):
        raise WorkloadError(f"{target} has no function {func!r} (from {ref!r}).")
    return getattr(module, func)


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


def params_json(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)
