"""campaign.yaml -> a validated Campaign record. Every problem is reported at once, with its key path."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import CampaignError
from planner.records import OPTIMIZERS, PRECISIONS
from planner.yamlsafe import Problems, load_yaml_file, load_yaml_text

TOP_KEYS = {"name", "workload", "params", "seq_len", "effective_batch", "updates", "eval", "export", "setup_hours",
            "stop_if", "variants", "precision", "optimizer", "checkpointing", "budget_usd", "headroom", "notes",
            "compare", "micro_batch"}
# What a variant may change: the declared variable (and its seed). Anything else would change what is compared.
COMPARABLE = {"lr"}
HELD_FIXED = TOP_KEYS - {"name", "variants", "budget_usd", "headroom", "notes", "setup_hours", "compare"}
EVAL_KEYS = {"every_updates", "examples", "seq_len", "micro_batch"}
STOP_KEYS = {"nonfinite", "loss_above"}
VARIANT_KEYS = {"id", "priority", "lr", "seed", "note"}
EXPORTS = ("model", "adapter")


@dataclass(frozen=True)
class Variant:
    id: str
    lr: float
    priority: int = 1
    seed: int = 0
    note: str = ""


@dataclass(frozen=True)
class EvalSpec:
    every_updates: int
    examples: int
    seq_len: int
    micro_batch: int | None = None

    def passes(self, updates: int) -> int:
        """Evaluations in a run of `updates`: every `every_updates`, plus a final one (never skipped)."""
        return updates // self.every_updates + (1 if updates % self.every_updates else 0)


@dataclass(frozen=True)
class Campaign:
    name: str
    workload: str
    params: dict
    effective_batch: int
    updates: int
    eval: EvalSpec
    variants: tuple[Variant, ...]
    seq_len: int | None = None
    export: str = "model"
    setup_hours: float = 1.0
    precision: str = "bf16"
    optimizer: str = "adamw"
    checkpointing: bool = False
    budget_usd: float | None = None
    stop_if: dict = field(default_factory=lambda: {"nonfinite": True})
    source: str = ""
    micro_batch: int | None = None
    compare: str = "lr"

    @property
    def params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)


def load_campaign(path: str | Path) -> Campaign:
    return parse_campaign(load_yaml_file(path, "campaign"), str(path))


def load_campaign_text(text: str, source: str) -> Campaign:
    return parse_campaign(load_yaml_text(text, source), source)


def parse_campaign(data, source: str) -> Campaign:
    p = Problems(source)
    if not isinstance(data, dict):
        p.add("", "a campaign must be a mapping (name:, workload:, variants: ...)")
        p.raise_if_any(CampaignError)
    p.unknown_keys("", data, TOP_KEYS)
    p.require("", data, ["name", "workload", "effective_batch", "updates", "eval", "variants"])
    for key in ("name", "workload"):
        if data.get(key) is not None:
            p.text(key, data[key])
    for key in ("effective_batch", "updates", "seq_len"):
        if data.get(key) is not None:
            p.number(key, data[key], positive=True, integer=True)
    if data.get("setup_hours") is not None:
        p.number("setup_hours", data["setup_hours"], positive=True, allow_zero=True)
    if data.get("budget_usd") is not None:
        p.number("budget_usd", data["budget_usd"], positive=True)
    if data.get("params") is not None and not isinstance(data["params"], dict):
        p.add("params", "must be a mapping of workload parameters")
    if data.get("export", "model") not in EXPORTS:
        p.add("export", f"must be one of {', '.join(EXPORTS)}, got {data.get('export')!r}")
    if data.get("precision", "bf16") not in PRECISIONS:
        p.add("precision", f"must be one of {', '.join(PRECISIONS)}, got {data.get('precision')!r}")
    if data.get("optimizer", "adamw") not in OPTIMIZERS:
        p.add("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {data.get('optimizer')!r}")
    if data.get("checkpointing") is not None:
        p.boolean("checkpointing", data["checkpointing"])
    if data.get("compare", "lr") not in COMPARABLE:
        p.add("compare", f"the declared variable must be one of {', '.join(sorted(COMPARABLE))}, "
                         f"got {data.get('compare')!r}")
    if data.get("micro_batch") is not None:
        mb = p.number("micro_batch", data["micro_batch"], positive=True, integer=True)
        eb = data.get("effective_batch")
        if mb and isinstance(eb, int) and eb % int(mb):
            p.add("micro_batch", f"{mb} does not divide effective_batch {eb}")
    ev = data.get("eval")
    if ev is not None and p.mapping("eval", ev, EVAL_KEYS, "a mapping with every_updates, examples, seq_len"):
        p.require("eval", ev, ["every_updates", "examples", "seq_len"])
        for key in EVAL_KEYS:
            if ev.get(key) is not None:
                p.number(f"eval.{key}", ev[key], positive=True, integer=True)
    stop = data.get("stop_if")
    if stop is not None and p.mapping("stop_if", stop, STOP_KEYS) is not None:
        if "nonfinite" in stop:
            p.boolean("stop_if.nonfinite", stop["nonfinite"])
        if "loss_above" in stop:
            p.number("stop_if.loss_above", stop["loss_above"], positive=True)
    variants = data.get("variants")
    ids: set = set()
    if variants is not None:
        if not isinstance(variants, list) or not variants:
            p.add("variants", "must be a non-empty list")
        else:
            for i, v in enumerate(variants):
                path = f"variants[{i}]"
                if not isinstance(v, dict):
                    p.add(path, "must be a mapping with id, lr, priority")
                    continue
                held = sorted(k for k in v if k in HELD_FIXED)
                for k in held:
                    p.add(f"{path}.{k}", f"a variant may change only the declared variable "
                                         f"({data.get('compare', 'lr')}); changing {k} would make the comparison "
                                         f"unfair (architecture, data, effective batch and updates stay as the control's)")
                p.unknown_keys(path, {k: x for k, x in v.items() if k not in held}, VARIANT_KEYS)
                p.require(path, v, ["id", "lr"])
                if v.get("id") is not None and p.text(f"{path}.id", v["id"]) is not None:
                    if v["id"] in ids:
                        p.add(f"{path}.id", f"duplicate variant id {v['id']!r}")
                    ids.add(v["id"])
                if v.get("lr") is not None:
                    p.number(f"{path}.lr", v["lr"], positive=True)
                if v.get("priority") is not None:
                    p.number(f"{path}.priority", v["priority"], positive=True, integer=True)
                if v.get("seed") is not None:
                    p.number(f"{path}.seed", v["seed"], positive=True, allow_zero=True, integer=True)
    p.raise_if_any(CampaignError)
    ev = data["eval"]
    return Campaign(
        name=data["name"], workload=data["workload"], params=dict(data.get("params") or {}),
        effective_batch=_int(data["effective_batch"]), updates=_int(data["updates"]),
        eval=EvalSpec(_int(ev["every_updates"]), _int(ev["examples"]), _int(ev["seq_len"]),
                      _int(ev["micro_batch"]) if ev.get("micro_batch") else None),
        variants=tuple(Variant(id=v["id"], lr=float(v["lr"]), priority=_int(v.get("priority") or 1),
                               seed=_int(v.get("seed") or 0), note=str(v.get("note") or "")) for v in data["variants"]),
        seq_len=_int(data["seq_len"]) if data.get("seq_len") else None, export=data.get("export", "model"),
        setup_hours=float(data.get("setup_hours", 1.0)), precision=data.get("precision", "bf16"),
        optimizer=data.get("optimizer", "adamw"), checkpointing=bool(data.get("checkpointing", False)),
        budget_usd=float(data["budget_usd"]) if data.get("budget_usd") else None,
        stop_if=dict(data.get("stop_if") or {"nonfinite": True}), source=source,
        micro_batch=_int(data["micro_batch"]) if data.get("micro_batch") else None, compare=data.get("compare", "lr"))


def _int(x) -> int:
    return int(float(x))  # validated above; numbers written as 1e3 arrive as strings
