"""Schemas of the files a user hands in, with pydantic v2: every field of a catalog entry has a type, a bound and a
message, unknown keys are refused by name, and a wrong type (a list where a name goes, an integer of 5,000 digits)
is an `Error:` naming its key, never a traceback.

Why pydantic: it is the validation library people know, its core is compiled (a 60,000-offer catalog validates in
about a second), and its errors carry the key path. The field rules themselves are the project's own (planner/inputs/
yamlsafe.Problems: numbers YAML 1.1 reads as text count as numbers, names are one printable line, ids are ASCII),
attached to each field, so a message reads the same whichever file it comes from.
"""

from __future__ import annotations

import difflib
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, StringConstraints, ValidationError

from planner.inputs.yamlsafe import Problems
from planner.records import canonical_precision


def _rule(method: str, **kw):
    def validate(value: Any):
        p = Problems("")
        out = getattr(p, method)("", value, **kw)
        if p.items:
            raise ValueError(p.items[0])
        return out
    return BeforeValidator(validate)


def _matching(pattern: str, what: str):
    rx = re.compile(pattern)

    def validate(value: Any):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # YAML reads 8.0 as a number
        if not isinstance(value, str) or not rx.fullmatch(value):
            raise ValueError(f"must be {what}, got {Problems.show(value)}")
        return value
    return BeforeValidator(validate)


def Number(**kw):  # noqa: N802  a type constructor
    return Annotated[float, _rule("number", **kw)]


def Whole(**kw):  # noqa: N802
    return Annotated[int, _rule("number", integer=True, **kw)]


Label = Annotated[str, _rule("label")]
_DATE = re.compile(r"(before )?(\d{4}-\d{2}(-\d{2})?)", re.ASCII)


def _price_date(value: Any):
    """A price's date: YYYY-MM-DD or YYYY-MM (a real one), 'before YYYY-MM-DD', or 'unknown (why)'; YAML's own
    dates (an unquoted 2026-01-21) as written."""
    import datetime as dt

    if isinstance(value, dt.date):
        return value.isoformat()
    text = value if isinstance(value, str) else ""
    m = _DATE.fullmatch(text)
    try:
        if m and dt.date.fromisoformat(m.group(2) if m.group(3) else m.group(2) + "-01"):
            return text
    except ValueError:
        pass
    if text == "unknown" or (text.startswith("unknown (") and text.endswith(")")):
        return _rule("label").func(text)
    raise ValueError(f"{Problems.show(value)} is not a date: write YYYY-MM-DD, YYYY-MM, 'before YYYY-MM-DD' or "
                     "'unknown (why)'")


PriceDate = Annotated[str, BeforeValidator(_price_date)]
Ident = Annotated[str, _rule("ident")]
Flag = Annotated[bool, _rule("boolean")]
ComputeCapability = Annotated[str, _matching(r"[0-9]{1,2}\.[0-9]", "a compute capability like '8.0'")]
CudaVersion = Annotated[str, _matching(r"[0-9]{1,2}(\.[0-9]{1,2}){0,2}", "a CUDA version like '12.1'")]
Names = tuple[Label, ...]


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)

    if typing.TYPE_CHECKING:  # the spec's and the order's models are built by functions, with their limits
        def __getattr__(self, name: str) -> Any: ...


def _tflops():
    return Number(positive=True, minimum=0.1, maximum=1e5)


class GpuEntry(Entry):
    id: Ident
    name: Label
    vendor: Label
    memory_gb_marketed: Number(positive=True, minimum=0.25, maximum=4096)
    memory_gib_usable: Number(positive=True, minimum=0.25, maximum=4096)
    mem_bandwidth_tbps: Number(positive=True, minimum=0.01, maximum=100)
    bf16_supported: Flag
    fp8_supported: Flag
    arch: Label | None = None
    compute_capability: ComputeCapability | None = None
    bf16_dense_tflops: _tflops() | None = None
    fp16_dense_tflops: _tflops() | None = None
    tf32_dense_tflops: _tflops() | None = None
    fp32_tflops: _tflops() | None = None
    fp8_dense_tflops: _tflops() | None = None
    mamf_bf16_tflops: _tflops() | None = None
    sm_count: Whole(positive=True, maximum=1024) | None = None  # streaming multiprocessors: GEMM waves
    nvlink_gbps: Number(positive=True, minimum=1, maximum=1e5) | None = None
    tdp_w: Number(positive=True, minimum=1, maximum=1e5) | None = None
    interconnect: Label | None = None
    min_cuda: CudaVersion | None = None
    software: Literal["cuda", "rocm"] = "cuda"
    notes: Label | None = None
    sources: Names = ()
    unverified: Names = ()


class OfferEntry(Entry):
    id: Ident  # reaches sky.yaml and shell lines: ASCII, look-alikes refused by name
    gpu: Ident
    provider: Ident
    gpus_per_instance: Whole(positive=True, maximum=64)
    price_per_instance_hour_usd: Number(positive=True, minimum=1e-4, maximum=10_000)
    spot: Flag
    as_of: PriceDate
    source: Label
    billing_minimum_hours: Number(positive=True, allow_zero=True, maximum=8760) = 0.0
    instance: Label | None = None
    note: Label | None = None
    nodes: Whole(positive=True, maximum=4096) = 1
    network: Label | None = None
    network_gbps: Number(positive=True, maximum=100_000) | None = None
    disk_write_mib_s: Number(positive=True, minimum=1, maximum=1e6) | None = None
    unverified: Names = ()


class Defaults(Entry):
    cuda_context_gib: Number(positive=True, allow_zero=True, maximum=64) = 0.5
    fragmentation_factor: Number(positive=True, minimum=1, maximum=10) = 1.15
    disk_write_mib_s: Number(positive=True, minimum=1, maximum=1e6) = 200.0


E = typing.TypeVar("E", bound=Entry)


def validate(model: type[E], data: Any, p: Problems, path: str) -> E | None:
    """The entry, or None with every problem added to `p` under `path` (key paths as the YAML spells them)."""
    if not isinstance(data, dict):
        p.add(path, "must be a mapping")
        return None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        for err in e.errors(include_url=False, include_input=False):
            where = ".".join([path, *(f"[{x}]" if isinstance(x, int) else str(x) for x in err["loc"])]) \
                .replace(".[", "[").lstrip(".")
            p.add(where, _message(dict(err), model))
        return None


def _model_at(model: type[Entry], loc) -> type[Entry]:
    """The entry model at a key path (the nested one an unknown key sits in)."""
    for part in loc:
        if isinstance(part, int) or part not in model.model_fields:
            continue  # a list index: the same item model
        inner = _entry_in(model.model_fields[part].annotation)
        if inner is None:
            break
        model = inner
    return model


def _entry_in(annotation):
    if isinstance(annotation, type) and issubclass(annotation, Entry):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := _entry_in(a))), None)


def _message(err: dict, model: type[Entry]) -> str:
    kind = err["type"]
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        key, fields = str(err["loc"][-1]), list(_model_at(model, err["loc"][:-1]).model_fields)
        hint = difflib.get_close_matches(key, fields, n=1)
        return "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(fields))})")
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']}"
    if kind == "tuple_type":
        return "must be a list of names"
    if kind == "list_type":
        return "must be a list"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "must be a mapping"
    return err["msg"][0].lower() + err["msg"][1:]


# ---------------------------------------------------------------- the campaign spec (campaign.yaml)

def _choice(options: tuple[str, ...], canonical=None):
    """One of `options` (after `canonical`, e.g. Lightning's precision names), said with the value given."""
    def validate(value: Any):
        v = canonical(value) if canonical and isinstance(value, str) else value
        if v not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {Problems.show(value)}")
        return v
    return BeforeValidator(validate)


def Choice(options, canonical=None):  # noqa: N802  a type constructor
    return Annotated[str, _choice(tuple(options), canonical)]


def _text(value: Any):
    return value if value is None else str(value)


class EvalSpecEntry(Entry):
    every_updates: Whole(positive=True, maximum=10**9)
    examples: Whole(positive=True, maximum=10**9)
    seq_len: Whole(positive=True, maximum=10**9)
    micro_batch: Whole(positive=True, maximum=10**9) | None = None


class StopEntry(Entry):
    nonfinite: Flag | None = None
    diverged: Flag | None = None
    loss_above: Number(positive=True) | None = None


class QualityEntry(Entry):
    metric: Choice(("val_loss", "val_accuracy"))
    max_worse: Number(positive=True, allow_zero=True)


def spec_models(limits: dict, precisions, optimizers, exports, settings):
    """The campaign spec's models, bounded by the spec module's own limits and choices (one place for each)."""
    Precision = Choice(precisions, canonical=canonical_precision)
    MicroBatch = Whole(positive=True, maximum=limits["effective_batch"])
    Lr = Number(positive=True, maximum=limits["lr"])

    class VariantEntry(Entry):
        id: Label
        lr: Lr | None = None
        priority: Whole(positive=True, maximum=10**9) | None = None
        seed: Whole(positive=True, allow_zero=True, maximum=2**63 - 1) | None = None
        note: Annotated[str | None, BeforeValidator(_text)] = None
        micro_batch: MicroBatch | None = None
        checkpointing: Flag | None = None
        precision: Precision | None = None

    class CampaignEntry(Entry):
        name: Label
        workload: Label
        params: dict[str, Any] | None = None
        effective_batch: Whole(positive=True, maximum=limits["effective_batch"])
        updates: Whole(positive=True, maximum=limits["updates"])
        seq_len: Whole(positive=True, maximum=limits["seq_len"]) | None = None
        eval: EvalSpecEntry
        export: Choice(exports) = "model"
        setup_hours: Number(positive=True, allow_zero=True, maximum=limits["setup_hours"]) = 1.0
        stop_if: StopEntry | None = None
        variants: list[VariantEntry]
        precision: Precision = "bf16"
        optimizer: Choice(optimizers) = "adamw"
        checkpointing: Flag = False
        budget_usd: Number(positive=True, maximum=limits["budget_usd"]) | None = None
        compare: Choice(settings) = "lr"
        micro_batch: MicroBatch | None = None
        lr: Lr | None = None
        diverge_above: Number(positive=True) | None = None
        quality_target: QualityEntry | None = None
        save_every_updates: Whole(positive=True, maximum=limits["updates"]) | None = None

    return CampaignEntry, VariantEntry


# ---------------------------------------------------------------- order.json (what `verify` reads on the machine)

class Open(Entry):
    """An object with the fields below checked and others (provenance, notes) kept as written."""
    model_config = ConfigDict(extra="allow", frozen=True)


def _listed(pattern: str, what: str, allowed: tuple[str, ...] | None = None):
    rx = re.compile(pattern)

    def validate(value: Any):
        if not isinstance(value, list) or not all(
                isinstance(x, str) and rx.fullmatch(x) and (allowed is None or x in allowed) for x in value):
            raise ValueError(f"must be {what}, got {Problems.show(value)}")
        return tuple(value)
    return Annotated[tuple[str, ...], BeforeValidator(validate)]


def order_models(device_kinds: tuple[str, ...], precisions, optimizers, extras: tuple[str, ...], module: str,
                 torch_requirement: str, format_name: str):
    """order.json's objects, each with every key `plan` writes (planner/outputs/orders.order_document) and no other:
    a hand-edited key (`stack.pakages`, a `settings.lr` verify would never read) is refused by its path."""
    Count = Whole(positive=True, maximum=1 << 20)
    Text = Label | None
    Note = Annotated[str, StringConstraints(max_length=20_000)] | None  # a basis: a sentence or two, read by people

    class ExpectEntry(Entry):
        device_kind: Choice(device_kinds)
        gpu_id: Text = None
        gpu_name: Text = None
        usable_bytes: Number(positive=True, maximum=2**50) | None = None
        gpus: Whole(positive=True, allow_zero=True, maximum=4096) | None = None
        compute_capability: Text = None
        bf16: Flag | None = None
        fp8: Flag | None = None
        min_cuda: Text = None
        torch: Text = None

    class SettingsEntry(Entry):
        workload: Label
        params: dict[str, Any]
        precision: Choice(precisions, canonical=canonical_precision)
        optimizer: Choice(optimizers)
        checkpointing: Flag | None = None
        micro_batch: Count
        grad_accum: Count
        seq_len: Count
        eval_micro_batch: Count
        eval_seq_len: Count
        replicas: Count | None = None
        strategy: Text = None
        strategy_label: Note = None

    class PlanEntry(Entry):
        need_bytes: Number(positive=True, maximum=2**60)
        update_s_low: Number(positive=True) | None = None
        update_s_high: Number(positive=True) | None = None
        update_s_point: Number(positive=True) | None = None
        need_phase: Text = None
        need_basis: Note = None
        context_bytes: Number(positive=True, allow_zero=True, maximum=2**60) | None = None
        context_basis: Note = None
        workspace_bytes: Number(positive=True, allow_zero=True, maximum=2**60) | None = None
        headroom: Number(positive=True, allow_zero=True, maximum=1) | None = None
        run_ids: Note | list[Label] = None
        time_basis: Note = None

    class StackEntry(Entry):
        torch_build: Choice(device_kinds)
        torch_requirement: Annotated[str, _matching(torch_requirement, "like 'torch==2.13.0'")]
        extras: _listed(r".+", f"a list of rentplan extras ({', '.join(extras)})", extras)
        packages: _listed(module, 'a list of module names like ["torch", "safetensors"]')

    class OfferRef(Entry):
        id: Ident | None = None
        provider: Text = None
        instance: Text = None
        gpus_per_instance: Whole(positive=True, allow_zero=True, maximum=64) | None = None
        nodes: Whole(positive=True, maximum=4096) | None = None
        spot: Flag | None = None
        region: Ident | None = None  # reaches sky.yaml
        network: Text = None
        price_per_instance_hour_usd: Number(positive=True, allow_zero=True) | None = None
        price_per_hour_usd: Number(positive=True, allow_zero=True) | None = None
        as_of: Text = None
        source: Text = None

    class ProvenanceEntry(Entry):  # planner/outputs/orders.provenance: one row per (mode, device, torch)
        mode: Choice(("measured", "estimated"))
        device: Label
        device_name: Text = None
        torch_version: Text = None
        cuda_version: Text = None
        lines: Whole(positive=True, maximum=10**12)
        first: Text = None
        last: Text = None

    class DecisionEntry(Entry):
        chosen_by: Text = None
        recommended: Text = None
        verdict: Text = None
        not_modelled: Any = None

    class OrderEntry(Entry):
        format: Annotated[str, _matching(re.escape(format_name), f"{format_name!r}: not a rentplan order")]
        expect: ExpectEntry
        settings: SettingsEntry
        plan: PlanEntry
        stack: StackEntry
        campaign: Text = None
        offer: OfferRef | None = None
        generated_at: Text = None
        provenance: list[ProvenanceEntry] | None = None
        decision: DecisionEntry | None = None

    return OrderEntry


# ---------------------------------------------------------------- an archive's manifest.json

class ArchivedFile(Open):
    sha256: Annotated[str, _matching(r"[0-9a-f]{64}", "a sha256 (64 hex digits)")]
    bytes: Whole(positive=True, allow_zero=True, maximum=2**60) | None = None


class ManifestEntry(Open):
    format: Annotated[str, _matching(r"rentplan-archive/1", "'rentplan-archive/1'")]
    run_id: Label
    files: dict[str, ArchivedFile]


# ---------------------------------------------------------------- a probe grid file (probe --grid FILE)

def _comma_list(item):
    """A YAML list or a comma string ("1,2,4"), each item checked by `item` (a Problems rule name)."""
    def validate(value: Any):
        items = value if isinstance(value, list) else str(value).split(",") if isinstance(value, (str, int)) \
            and not isinstance(value, bool) else None
        if items is None or not items:
            raise ValueError(f"must be a list or a comma string like '1,2,4', got {Problems.show(value)}")
        out = []
        for i, x in enumerate(items):
            p = Problems("")
            got = item(p, x.strip() if isinstance(x, str) else x)
            if p.items:
                raise ValueError(f"item {i + 1}: {p.items[0]}")
            out.append(got)
        return value
    return Annotated[Any, BeforeValidator(validate)]


def _whole_item(p: Problems, x):
    return p.number("", x, positive=True, integer=True, maximum=1 << 20)


def _word_item(p: Problems, x):
    return p.ident("", x)


def _switch_item(p: Problems, x):
    if isinstance(x, bool) or str(x).lower() in ("on", "off", "true", "false", "yes", "no", "1", "0"):
        return x
    p.add("", f"must be on or off, got {Problems.show(x)}")


class GridEntry(Entry):
    """The keys of `probe`'s options; their values are then read as the options are (planner/inputs/grid)."""
    workload: Label | None = None
    params: dict[str, Any] | list[Label] | None = None
    micro_batch: _comma_list(_whole_item) = None
    seq_len: _comma_list(_whole_item) = None
    eval_seq_len: _comma_list(_whole_item) = None
    grad_accum: _comma_list(_whole_item) = None
    precision: _comma_list(_word_item) = None
    optimizer: _comma_list(_word_item) = None
    checkpointing: _comma_list(_switch_item) = None
    eval_micro_batch: Whole(positive=True, maximum=1 << 20) | None = None
    effective_batch: Whole(positive=True, maximum=1 << 20) | None = None
    steady_updates: Whole(positive=True, maximum=10_000) | None = None
    nproc: Whole(positive=True, maximum=1024) | None = None
    lr: Number(positive=True, maximum=1e6) | None = None
    timeout_s: Number(positive=True, maximum=1e7) | None = None
    cap: Label | None = None
    device: Label | None = None
    strategy: Choice(("single", "ddp", "fsdp")) | None = None
