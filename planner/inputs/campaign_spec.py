"""campaign.yaml -> a validated Campaign record. Every problem is reported at once, with its key path."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import CampaignError
from planner.records import canonical_precision, OPTIMIZERS, PRECISIONS
from planner.inputs.yamlsafe import Problems, load_yaml_file, load_yaml_text

TOP_KEYS = {"name", "workload", "params", "seq_len", "effective_batch", "updates", "eval", "export", "setup_hours",
            "stop_if", "variants", "precision", "optimizer", "checkpointing", "budget_usd", "compare", "micro_batch", "lr", "diverge_above", "quality_target",
            "save_every_updates"}
# What a variant may change: how the same question is computed (learning rate, and the memory fixes: a smaller
# micro-batch with more accumulation, activation checkpointing, mixed precision), and its seed. Anything else
# (architecture, data, effective batch, updates) would change the question, and is refused by name.
VARIANT_SETTINGS = ("lr", "micro_batch", "checkpointing", "precision")
# Keys a spec once took and nothing read: refused with where the setting lives instead.
MOVED = {"headroom": "headroom is an option of plan (--headroom 0.1), not of the spec",
         "notes": "notes are not read from a spec: write YAML comments (# ...), or `rentplan note TEXT` for the ledger"}
HELD_FIXED = TOP_KEYS - {"name", "variants", "budget_usd", "setup_hours", "compare", "save_every_updates",
                         "diverge_above", "quality_target", *VARIANT_SETTINGS}
EVAL_KEYS = {"every_updates", "examples", "seq_len", "micro_batch"}
STOP_KEYS = {"nonfinite", "loss_above", "diverged"}
VARIANT_KEYS = {"id", "priority", "seed", "note", *VARIANT_SETTINGS}
QUALITY_KEYS = {"metric", "max_worse"}
QUALITY_METRICS = ("val_loss", "val_accuracy")
EXPORTS = ("model", "adapter")
# Bounds against typos and abuse, far above any real campaign (a bound is named in the error).
LIMITS = {"effective_batch": 1 << 20, "updates": 10**8, "seq_len": 1 << 20, "setup_hours": 8760.0,
          "budget_usd": 1e9, "lr": 1e6, "count": 10**9}
KEPT_CHECKPOINTS = 3  # a campaign run keeps its newest checkpoints (sky.yaml's disk is sized to hold them)
DIVERGE_ABOVE = 10.0  # a loss above 10 × the run's first loss is divergence, whatever the stop rules say


@dataclass(frozen=True)
class Variant:
    id: str
    lr: float
    priority: int = 1
    seed: int = 0
    note: str = ""
    micro_batch: int | None = None  # None: the campaign's
    checkpointing: bool | None = None
    precision: str | None = None


@dataclass(frozen=True)
class QualityTarget:
    """A variant holds the target when its seed-mean metric is at most `max_worse` (a fraction) worse than the
    control's: val_loss ≤ control × (1 + max_worse), val_accuracy ≥ control × (1 − max_worse)."""
    metric: str = "val_loss"
    max_worse: float = 0.02


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
    # Stop rules decide only whether a run keeps going; divergence is judged whatever they say.
    stop_if: dict = field(default_factory=lambda: {"nonfinite": True, "diverged": True})
    source: str = ""
    micro_batch: int | None = None
    compare: str = "lr"
    diverge_above: float = DIVERGE_ABOVE
    quality_target: QualityTarget | None = None
    base_dir: str = "."  # the spec's folder: relative paths in the spec are read from here
    save_every_updates: int | None = None  # None: a checkpoint at every evaluation

    @property
    def save_every(self) -> int:
        """Updates between checkpoint saves: the spec's save_every_updates, else eval.every_updates."""
        return self.save_every_updates or self.eval.every_updates

    def saves(self, updates: int | None = None) -> int:
        """Checkpoints saved in a run: every save_every updates, none at the end (the export is the end's)."""
        return ((updates or self.updates) - 1) // self.save_every

    @property
    def params_json(self) -> str:
        return json.dumps(self.params, sort_keys=True)

    @property
    def control(self) -> Variant:
        """The variant named `control`, else the first one declared."""
        return next((v for v in self.variants if v.id == "control"), self.variants[0])

    def setting(self, variant: Variant, key: str):
        """A variant's value of one of VARIANT_SETTINGS, falling back to the campaign's."""
        own = getattr(variant, key)
        return own if own is not None else getattr(self, key)

    def changed(self, variant: Variant) -> dict:
        """What this variant sets differently from the control (besides its id and seed)."""
        ctrl = self.control
        return {k: self.setting(variant, k) for k in VARIANT_SETTINGS
                if self.setting(variant, k) != self.setting(ctrl, k)}


def load_campaign(path: str | Path) -> Campaign:
    return parse_campaign(load_yaml_file(path, "campaign"), str(path), str(Path(path).resolve().parent))


def load_campaign_text(text: str, source: str) -> Campaign:
    return parse_campaign(load_yaml_text(text, source), source)


def resolve_path(text: str, base_dir: str) -> str:
    """A relative path in a spec is read from the spec's folder, whatever the working folder is."""
    p = Path(text).expanduser()
    return str(p if p.is_absolute() else Path(base_dir) / p)


def resolve_workload(ref: str, base_dir: str) -> str:
    """`file.py:fn` and `hf:PATH` name files: relative ones are read from the spec's folder. Module references
    (`package.module:fn`) and built-ins are left as they are."""
    if ref.startswith("builtin:"):
        return ref
    if ref.startswith("hf:"):
        return "hf:" + resolve_path(ref[3:], base_dir)
    target, sep, func = ref.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{resolve_path(target, base_dir)}:{func}"
    return ref


FILE_PARAMS = ("data", "val_data")  # workload params that name files: read from the spec's folder too


def resolve_params(params: dict, base_dir: str) -> dict:
    return {k: (resolve_path(v, base_dir) if k in FILE_PARAMS and isinstance(v, str) else v)
            for k, v in params.items()}


def parse_campaign(data, source: str, base_dir: str = ".") -> Campaign:
    p = Problems(source)
    if not isinstance(data, dict):
        p.add("", "a campaign must be a mapping (name:, workload:, variants: ...)")
        p.raise_if_any(CampaignError)
    for key, why in MOVED.items():
        if key in data:
            p.add(key, why)
    p.unknown_keys("", {k: v for k, v in data.items() if k not in MOVED}, TOP_KEYS)
    p.require("", data, ["name", "workload", "effective_batch", "updates", "eval", "variants"])
    for key in ("name", "workload"):  # both reach order.json and sky.yaml: one printable line each
        if data.get(key) is not None:
            p.label(key, data[key])
    counts = {}
    for key in ("effective_batch", "updates", "seq_len"):
        if data.get(key) is not None:
            counts[key] = p.number(key, data[key], positive=True, integer=True, maximum=LIMITS[key])
    if data.get("save_every_updates") is not None:
        p.number("save_every_updates", data["save_every_updates"], positive=True, integer=True,
                 maximum=LIMITS["updates"])
    if data.get("setup_hours") is not None:
        p.number("setup_hours", data["setup_hours"], positive=True, allow_zero=True, maximum=LIMITS["setup_hours"])
    if data.get("budget_usd") is not None:
        p.number("budget_usd", data["budget_usd"], positive=True, maximum=LIMITS["budget_usd"])
    if data.get("params") is not None and not isinstance(data["params"], dict):
        p.add("params", "must be a mapping of workload parameters")
    elif isinstance(data.get("params"), dict):
        for key in FILE_PARAMS:  # files the launch carries to the rented machine
            if data["params"].get(key) is not None:
                p.label(f"params.{key}", data["params"][key])
    if data.get("export", "model") not in EXPORTS:
        p.add("export", f"must be one of {', '.join(EXPORTS)}, got {data.get('export')!r}")
    if isinstance(data.get("precision"), str):  # Lightning's names (bf16-mixed, 32-true, ...) are aliases
        data["precision"] = canonical_precision(data["precision"])
    if data.get("precision", "bf16") not in PRECISIONS:
        p.add("precision", f"must be one of {', '.join(PRECISIONS)}, got {data.get('precision')!r}")
    if data.get("optimizer", "adamw") not in OPTIMIZERS:
        p.add("optimizer", f"must be one of {', '.join(OPTIMIZERS)}, got {data.get('optimizer')!r}")
    if data.get("checkpointing") is not None:
        p.boolean("checkpointing", data["checkpointing"])
    if data.get("compare", "lr") not in VARIANT_SETTINGS:
        p.add("compare", f"the declared variable must be one of {', '.join(VARIANT_SETTINGS)}, "
                         f"got {data.get('compare')!r}")
    if data.get("micro_batch") is not None:
        _micro_batch(p, "micro_batch", data["micro_batch"], counts.get("effective_batch"))
    if data.get("lr") is not None:
        p.number("lr", data["lr"], positive=True, maximum=LIMITS["lr"])
    if data.get("diverge_above") is not None:
        k = p.number("diverge_above", data["diverge_above"], positive=True)
        if k is not None and k <= 1:
            p.add("diverge_above", f"must be above 1 (a multiple of the run's first loss), got {k}")
    qt = data.get("quality_target")
    if qt is not None and p.mapping("quality_target", qt, QUALITY_KEYS, "a mapping with metric and max_worse"):
        p.require("quality_target", qt, ["metric", "max_worse"])
        if qt.get("metric") is not None and qt["metric"] not in QUALITY_METRICS:
            p.add("quality_target.metric", f"must be one of {', '.join(QUALITY_METRICS)}, got {qt['metric']!r}")
        if qt.get("max_worse") is not None:
            w = p.number("quality_target.max_worse", qt["max_worse"], positive=True, allow_zero=True)
            if w is not None and w >= 1:
                p.add("quality_target.max_worse", f"is a fraction of the control's metric (0.02 = 2 %), got {w}")
    ev = data.get("eval")
    if ev is not None and p.mapping("eval", ev, EVAL_KEYS, "a mapping with every_updates, examples, seq_len"):
        p.require("eval", ev, ["every_updates", "examples", "seq_len"])
        for key in EVAL_KEYS:
            if ev.get(key) is not None:
                p.number(f"eval.{key}", ev[key], positive=True, integer=True, maximum=LIMITS["count"])
    stop = data.get("stop_if")
    if stop is not None and p.mapping("stop_if", stop, STOP_KEYS) is not None:
        if "nonfinite" in stop and p.boolean("stop_if.nonfinite", stop["nonfinite"]) is False:
            p.add("stop_if.nonfinite", "a non-finite loss always ends a run (its weights are gone); remove the key")
        if "diverged" in stop:
            p.boolean("stop_if.diverged", stop["diverged"])
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
                    p.add(f"{path}.{k}", f"a variant may change only {', '.join(VARIANT_SETTINGS)} and its "
                                         f"seed; changing {k} would change the question (architecture, data, "
                                         f"effective batch and updates stay as the control's)")
                p.unknown_keys(path, {k: x for k, x in v.items() if k not in held}, VARIANT_KEYS)
                p.require(path, v, ["id"] if data.get("lr") is not None else ["id", "lr"])
                if v.get("id") is not None and p.label(f"{path}.id", v["id"]) is not None:
                    if v["id"] in ids:
                        p.add(f"{path}.id", f"duplicate variant id {v['id']!r}")
                    ids.add(v["id"])
                if v.get("lr") is not None:
                    p.number(f"{path}.lr", v["lr"], positive=True, maximum=LIMITS["lr"])
                if v.get("priority") is not None:
                    p.number(f"{path}.priority", v["priority"], positive=True, integer=True)
                if v.get("seed") is not None:
                    p.number(f"{path}.seed", v["seed"], positive=True, allow_zero=True, integer=True)
                if v.get("micro_batch") is not None:
                    _micro_batch(p, f"{path}.micro_batch", v["micro_batch"], counts.get("effective_batch"))
                if v.get("checkpointing") is not None:
                    p.boolean(f"{path}.checkpointing", v["checkpointing"])
                if isinstance(v.get("precision"), str):
                    v["precision"] = canonical_precision(v["precision"])
                if v.get("precision") is not None and v["precision"] not in PRECISIONS:
                    p.add(f"{path}.precision", f"must be one of {', '.join(PRECISIONS)}, got {v['precision']!r}")
    p.raise_if_any(CampaignError)
    ev = data["eval"]
    return Campaign(
        name=data["name"], workload=data["workload"], params=dict(data.get("params") or {}),
        effective_batch=_int(data["effective_batch"]), updates=_int(data["updates"]),
        eval=EvalSpec(_int(ev["every_updates"]), _int(ev["examples"]), _int(ev["seq_len"]),
                      _int(ev["micro_batch"]) if ev.get("micro_batch") else None),
        variants=tuple(Variant(id=v["id"], lr=float(v["lr"] if v.get("lr") is not None else data["lr"]),
                               priority=_int(v.get("priority") or 1), seed=_int(v.get("seed") or 0),
                               note=str(v.get("note") or ""),
                               micro_batch=_int(v["micro_batch"]) if v.get("micro_batch") else None,
                               checkpointing=bool(v["checkpointing"]) if v.get("checkpointing") is not None else None,
                               precision=v.get("precision")) for v in data["variants"]),
        seq_len=_int(data["seq_len"]) if data.get("seq_len") else None, export=data.get("export", "model"),
        setup_hours=float(data.get("setup_hours", 1.0)), precision=data.get("precision", "bf16"),
        optimizer=data.get("optimizer", "adamw"), checkpointing=bool(data.get("checkpointing", False)),
        budget_usd=float(data["budget_usd"]) if data.get("budget_usd") else None,
        stop_if={"nonfinite": True, "diverged": True, **(data.get("stop_if") or {})}, source=source,
        micro_batch=_int(data["micro_batch"]) if data.get("micro_batch") else None, compare=data.get("compare", "lr"),
        diverge_above=float(data.get("diverge_above") or DIVERGE_ABOVE),
        quality_target=QualityTarget(qt["metric"], float(qt["max_worse"])) if qt else None, base_dir=base_dir,
        save_every_updates=_int(data["save_every_updates"]) if data.get("save_every_updates") else None)


def _micro_batch(p: Problems, path: str, value, effective_batch) -> None:
    mb = p.number(path, value, positive=True, integer=True, maximum=LIMITS["effective_batch"])
    if mb and effective_batch and int(effective_batch) % int(mb):
        p.add(path, f"{int(mb)} does not divide effective_batch {int(effective_batch)} (accumulation must be whole)")


def _int(x) -> int:
    return int(float(x))  # validated above; numbers written as 1e3 arrive as strings


def judge_loss(loss: float, first_loss: float | None, diverge_above: float) -> str | None:
    """Why this update's loss is divergence, or None. Non-finite, or above k × the run's first loss."""
    if not math.isfinite(loss):
        return "non-finite loss"
    if first_loss is not None and math.isfinite(first_loss) and first_loss > 0 and loss > diverge_above * first_loss:
        return f"loss {loss:.4g} above {diverge_above:g} × the first loss {first_loss:.4g}"
    return None
