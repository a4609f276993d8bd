"""campaign.yaml -> a validated Campaign record. Every problem is reported at once, with its key path."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from planner.errors import CampaignError, InputError
from planner.inputs.grid import param_value
from planner.inputs.schema import spec_models, validate
from planner.inputs.yamlsafe import Problems, load_yaml_file, load_yaml_text
from planner.optimizers import OPTIMIZERS
from planner.records import PRECISIONS

# What a variant may change: how the same question is computed (learning rate, and the memory fixes: a smaller
# micro-batch with more accumulation, activation checkpointing, mixed precision), and its seed. Anything else
# (architecture, data, effective batch, updates) would change the question, and is refused by name.
VARIANT_SETTINGS = ("lr", "micro_batch", "checkpointing", "precision")
# Keys a spec once took and nothing read: refused with where the setting lives instead.
MOVED = {"headroom": "headroom is an option of plan (--headroom 0.1), not of the spec",
         "notes": "notes are not read from a spec: write YAML comments (# ...), or `rentplan note TEXT` for the ledger"}
EXPORTS = ("model", "adapter")
# Bounds against typos and abuse, far above any real campaign (a bound is named in the error).
LIMITS = {"effective_batch": 1 << 20, "updates": 10**8, "seq_len": 1 << 20, "setup_hours": 8760.0,
          "budget_usd": 1e9, "lr": 1e6, "count": 10**9}
KEPT_CHECKPOINTS = 3  # a campaign run keeps its newest checkpoints (sky.yaml's disk is sized to hold them)
DIVERGE_ABOVE = 10.0  # a loss above 10 × the run's first loss is divergence, whatever the stop rules say
CampaignEntry, VariantEntry = spec_models(LIMITS, PRECISIONS, OPTIMIZERS, EXPORTS, VARIANT_SETTINGS)
HELD_FIXED = set(CampaignEntry.model_fields) - {"name", "variants", "budget_usd", "setup_hours", "compare",
                                                "save_every_updates", "diverge_above", "quality_target",
                                                *VARIANT_SETTINGS}


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


@dataclass(frozen=True)
class StopRules:
    """The divergence and stop rules answered into plain values: a run's loop reads these, never the spec."""
    diverge_above: float  # a loss above this × the run's first loss is divergence
    on_divergence: bool  # stop_if.diverged: a divergence ends the run (else it is recorded and the run goes on)
    loss_above: float | None  # stop_if.loss_above: a loss above it stops the run


@dataclass(frozen=True)
class RunVariant:
    """One variant as `campaign run` trains it: its settings fallen back to the campaign's, and what it changes."""
    id: str
    lr: float
    priority: int
    seed: int
    micro_batch: int | None  # None: the run picks the largest that divides its examples per process (up to 8)
    precision: str
    checkpointing: bool
    changes: dict  # what it sets differently from the control (Campaign.changed)


@dataclass(frozen=True)
class CampaignRun:
    """The spec resolved once, at load, into what a campaign run needs: paths read from the spec's folder, every
    variant's settings answered, the stop rules plain values. probes/campaign.py runs from this alone."""
    name: str
    source: str
    workload: str  # resolved: file.py:fn and hf:PATH from the spec's folder
    params: dict  # resolved: data and val_data from the spec's folder
    seq_len: int
    effective_batch: int
    updates: int
    optimizer: str
    eval: EvalSpec
    save_every: int
    export_adapter: bool
    control: str
    quality_target: dict | None
    stop_if: dict  # as the spec says it (recorded with each run)
    rules: StopRules
    variants: tuple[RunVariant, ...]


def campaign_run(campaign: Campaign, variants: tuple[Variant, ...] | list[Variant] | None = None) -> CampaignRun:
    """What a campaign run of `variants` (default: all) needs from the spec, answered now."""
    chosen = campaign.variants if variants is None else variants
    return CampaignRun(
        name=campaign.name, source=campaign.source, workload=resolve_workload(campaign.workload, campaign.base_dir),
        params=resolve_params(campaign.params, campaign.base_dir), seq_len=campaign.seq_len or 128,
        effective_batch=campaign.effective_batch, updates=campaign.updates, optimizer=campaign.optimizer,
        eval=campaign.eval, save_every=campaign.save_every, export_adapter=campaign.export == "adapter",
        control=campaign.control.id,
        quality_target=asdict(campaign.quality_target) if campaign.quality_target else None,
        stop_if=dict(campaign.stop_if),
        rules=StopRules(campaign.diverge_above, bool(campaign.stop_if.get("diverged", True)),
                        campaign.stop_if.get("loss_above")),
        variants=tuple(RunVariant(id=v.id, lr=v.lr, priority=v.priority, seed=v.seed,
                                  micro_batch=campaign.setting(v, "micro_batch"),
                                  precision=campaign.setting(v, "precision"),
                                  checkpointing=bool(campaign.setting(v, "checkpointing")),
                                  changes=campaign.changed(v)) for v in chosen))


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


def _numbers_as_meant(p: Problems, params: dict) -> dict:
    """The workload's params as `-p` reads them: 1e1 is 10, not the string YAML 1.1 makes of it."""
    out = {}
    for key, value in params.items():
        try:
            out[key] = param_value(str(key), value, label="params.")
        except InputError as e:
            p.add(f"params.{key}", str(e).split(": ", 1)[-1])
    return out


FILE_PARAMS = ("data", "val_data")  # workload params that name files: read from the spec's folder too


def resolve_params(params: dict, base_dir: str) -> dict:
    return {k: (resolve_path(v, base_dir) if k in FILE_PARAMS and isinstance(v, str) else v)
            for k, v in params.items()}


def parse_campaign(data, source: str, base_dir: str = ".") -> Campaign:
    """Every field by the spec's schema (planner/inputs/schema: a type, a bound and a message each), then the
    rules that join fields: what a variant may change, whole accumulation, unique ids."""
    p = Problems(source)
    if not isinstance(data, dict):
        p.add("", "a campaign must be a mapping (name:, workload:, variants: ...)")
        p.raise_if_any(CampaignError)
    data = dict(data)
    for key, why in MOVED.items():
        if key in data:
            data.pop(key)
            p.add(key, why)
    variants = data.get("variants")
    if isinstance(variants, list):  # a held-fixed key in a variant is said as such, not as an unknown key
        data["variants"] = [_without_held(p, f"variants[{i}]", v) for i, v in enumerate(variants)]
    spec = validate(CampaignEntry, data, p, "")
    params: dict = {}
    if spec is not None:
        _joined_rules(p, spec)
        params = _numbers_as_meant(p, spec.params or {})
    p.raise_if_any(CampaignError)
    assert spec is not None  # validate() said why it could not, and that was raised above
    ev, qt = spec.eval, spec.quality_target
    return Campaign(
        name=spec.name, workload=spec.workload, params=params,
        effective_batch=spec.effective_batch, updates=spec.updates,
        eval=EvalSpec(ev.every_updates, ev.examples, ev.seq_len, ev.micro_batch),
        variants=tuple(Variant(id=v.id, lr=float(v.lr if v.lr is not None else spec.lr), priority=v.priority or 1,
                               seed=v.seed or 0, note=v.note or "", micro_batch=v.micro_batch,
                               checkpointing=v.checkpointing, precision=v.precision) for v in spec.variants),
        seq_len=spec.seq_len, export=spec.export, setup_hours=float(spec.setup_hours), precision=spec.precision,
        optimizer=spec.optimizer, checkpointing=spec.checkpointing, budget_usd=spec.budget_usd or None,
        stop_if={"nonfinite": True, "diverged": True,
                 **(spec.stop_if.model_dump(exclude_none=True) if spec.stop_if else {})},
        source=source, micro_batch=spec.micro_batch, compare=spec.compare,
        diverge_above=float(spec.diverge_above or DIVERGE_ABOVE),
        quality_target=QualityTarget(qt.metric, float(qt.max_worse)) if qt else None, base_dir=base_dir,
        save_every_updates=spec.save_every_updates)


def _without_held(p: Problems, path: str, v):
    if not isinstance(v, dict):
        return v
    for k in sorted(k for k in v if k in HELD_FIXED):
        p.add(f"{path}.{k}", f"a variant may change only {', '.join(VARIANT_SETTINGS)} and its seed; changing "
                             f"{k} would change the question (architecture, data, effective batch and updates "
                             "stay as the control's)")
    return {k: x for k, x in v.items() if k not in HELD_FIXED}


def _joined_rules(p: Problems, spec) -> None:
    if spec.params is not None:
        for key in FILE_PARAMS:  # files the launch carries to the rented machine
            if spec.params.get(key) is not None:
                p.label(f"params.{key}", spec.params[key])
    if not spec.variants:
        p.add("variants", "must be a non-empty list")
    if spec.diverge_above is not None and spec.diverge_above <= 1:
        p.add("diverge_above", f"must be above 1 (a multiple of the run's first loss), got {spec.diverge_above:g}")
    if spec.quality_target is not None and spec.quality_target.max_worse >= 1:
        p.add("quality_target.max_worse", "is a fraction of the control's metric (0.02 = 2 %), got "
                                          f"{spec.quality_target.max_worse:g}")
    if spec.stop_if is not None and spec.stop_if.nonfinite is False:
        p.add("stop_if.nonfinite", "a non-finite loss always ends a run (its weights are gone); remove the key")
    if spec.micro_batch is not None:
        _micro_batch(p, "micro_batch", spec.micro_batch, spec.effective_batch)
    ids: set = set()
    for i, v in enumerate(spec.variants):
        if v.lr is None and spec.lr is None:
            p.add(f"variants[{i}].lr", "missing")
        if v.id in ids:
            p.add(f"variants[{i}].id", f"duplicate variant id {v.id!r}")
        ids.add(v.id)
        if v.micro_batch is not None:
            _micro_batch(p, f"variants[{i}].micro_batch", v.micro_batch, spec.effective_batch)


def _micro_batch(p: Problems, path: str, mb: int, effective_batch: int) -> None:
    if effective_batch % mb:
        p.add(path, f"{mb} does not divide effective_batch {effective_batch} (accumulation must be whole)")

