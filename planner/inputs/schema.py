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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from planner.inputs.yamlsafe import Problems


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
Ident = Annotated[str, _rule("ident")]
Flag = Annotated[bool, _rule("boolean")]
ComputeCapability = Annotated[str, _matching(r"[0-9]{1,2}\.[0-9]", "a compute capability like '8.0'")]
CudaVersion = Annotated[str, _matching(r"[0-9]{1,2}(\.[0-9]{1,2}){0,2}", "a CUDA version like '12.1'")]
Names = tuple[Label, ...]


class Entry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=False)


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
    as_of: Label
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


def validate(model: type[Entry], data: Any, p: Problems, path: str) -> Entry | None:
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
            p.add(where, _message(err, model))
        return None


def _message(err: dict, model: type[Entry]) -> str:
    kind = err["type"]
    if kind == "missing":
        return "missing"
    if kind == "extra_forbidden":
        key = str(err["loc"][-1])
        hint = difflib.get_close_matches(key, list(model.model_fields), n=1)
        return "unknown key" + (f" (did you mean {hint[0]!r}?)" if hint else
                                f" (allowed: {', '.join(sorted(model.model_fields))})")
    if kind == "value_error":
        return str(err["ctx"]["error"])
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']}"
    if kind in ("tuple_type", "list_type"):
        return "must be a list of names"
    return err["msg"][0].lower() + err["msg"][1:]
