"""order.json as read back by `rentplan verify`: every problem named at once, before anything acts on it.
An order names a workload by reference only; the reference is resolved under the same rules as any other
(probes/workloads.py: the user's own function or class)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from planner.errors import InputError
from planner.records import OPTIMIZERS, PRECISIONS
from planner.yamlsafe import Problems

FORMAT = "rentplan-order/1"
DEVICE_KINDS = ("cuda", "rocm", "cpu")
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_ORDER_BYTES = 16 * 1024 * 1024


def load_order(path: str | Path) -> dict:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_ORDER_BYTES:
            raise InputError(f"{p} is over {MAX_ORDER_BYTES >> 20} MiB: not an order.json.")
        order = json.loads(p.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError covers bad JSON and bad UTF-8
        raise InputError(f"{p} is not a readable order.json ({e}). Make one with `rentplan plan --out DIR`.") \
            from None
    check_order(order, str(p))
    return order


def check_order(order, source: str) -> None:
    p = Problems(source)
    if not isinstance(order, dict):
        p.add("", "an order must be a JSON object (format, expect, settings, plan)")
        p.raise_if_any()
    if order.get("format") != FORMAT:
        p.add("format", f"must be {FORMAT!r}, got {order.get('format')!r}: not a rentplan order")
    p.require("", order, ["expect", "settings", "plan"])
    exp, settings, plan = order.get("expect"), order.get("settings"), order.get("plan")
    if isinstance(exp, dict):
        if exp.get("device_kind") not in DEVICE_KINDS:
            p.add("expect.device_kind", f"must be one of {', '.join(DEVICE_KINDS)}, got {exp.get('device_kind')!r}")
        if exp.get("device_kind") in ("cuda", "rocm"):
            p.require("expect", exp, ["gpu_id", "gpu_name", "usable_bytes"])
            for key in ("gpu_id", "gpu_name"):
                if exp.get(key) is not None:
                    p.text(f"expect.{key}", exp[key])
        if exp.get("usable_bytes") is not None:
            p.number("expect.usable_bytes", exp["usable_bytes"], positive=True, maximum=2**50)
        if exp.get("gpus") is not None:
            p.number("expect.gpus", exp["gpus"], positive=True, allow_zero=True, integer=True, maximum=4096)
    elif exp is not None:
        p.add("expect", "must be an object")
    if isinstance(settings, dict):
        p.require("settings", settings, ["workload", "params", "precision", "optimizer", "micro_batch", "grad_accum",
                                         "seq_len", "eval_micro_batch", "eval_seq_len"])
        if settings.get("workload") is not None:
            p.text("settings.workload", settings["workload"])
        if settings.get("params") is not None and not isinstance(settings["params"], dict):
            p.add("settings.params", "must be an object of workload parameters")
        if settings.get("precision") is not None and settings["precision"] not in PRECISIONS:
            p.add("settings.precision", f"must be one of {', '.join(PRECISIONS)}, got {settings['precision']!r}")
        if settings.get("optimizer") is not None and settings["optimizer"] not in OPTIMIZERS:
            p.add("settings.optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {settings['optimizer']!r}")
        if settings.get("checkpointing") is not None:
            p.boolean("settings.checkpointing", settings["checkpointing"])
        for key in ("micro_batch", "grad_accum", "seq_len", "eval_micro_batch", "eval_seq_len"):
            if settings.get(key) is not None:
                p.number(f"settings.{key}", settings[key], positive=True, integer=True, maximum=1 << 20)
    elif settings is not None:
        p.add("settings", "must be an object")
    if isinstance(plan, dict):
        p.require("plan", plan, ["need_bytes"])
        if plan.get("need_bytes") is not None:
            p.number("plan.need_bytes", plan["need_bytes"], positive=True, maximum=2**60)
        for key in ("update_s_low", "update_s_high"):
            if plan.get(key) is not None:
                p.number(f"plan.{key}", plan[key], positive=True)
    elif plan is not None:
        p.add("plan", "must be an object")
    packages = order.get("packages", [])
    if not isinstance(packages, list) or not all(isinstance(x, str) and MODULE.fullmatch(x) for x in packages):
        p.add("packages", f"must be a list of module names like [\"torch\", \"safetensors\"], got {packages!r}"[:300])
    p.raise_if_any()
