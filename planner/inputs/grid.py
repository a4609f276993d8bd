"""The probe grid: comma lists from options or a probe YAML file -> ProbeConfig records. No torch."""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from planner.errors import InputError
from planner.inputs.catalog import load_catalog
from planner.inputs.schema import GridEntry, validate
from planner.inputs.yamlsafe import Problems, load_yaml_file
from planner.models.kernels import TARGETS, kernel_target
from planner.optimizers import OPTIMIZERS
from planner.records import PRECISIONS, ProbeConfig, canonical_precision
from planner.units import parse_size

ON = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


def parse_list(text: str | int | list | None, cast: Callable[[str], Any], what: str) -> list:
    if text is None:
        return []
    items = text if isinstance(text, list) else str(text).split(",")
    out = []
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        try:
            out.append(cast(item))
        except (ValueError, KeyError) as e:
            why = f" ({e.args[0]})" if isinstance(e, ValueError) and e.args and isinstance(e.args[0], str) \
                and e.args[0].startswith("must") else ""
            raise InputError(f"{what}: {item[:40]!r} is not valid{why}.") from None
    return out


MAX_COUNT = 1 << 20  # micro-batches, sequence lengths, windows: far above any real one (a typo or an attack)


def positive_int(text: str) -> int:
    if not str(text).isascii():  # int() reads '１' and '٨' as digits
        raise ValueError("must be written in ASCII digits")
    v = int(text)
    if not 1 <= v <= MAX_COUNT:
        raise ValueError(f"must be a whole number from 1 to {MAX_COUNT:,}")
    return v


def on_off(text: str) -> bool:
    return ON[text.lower()]


_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", re.ASCII)
MAX_PARAM_INT = 2**63 - 1  # what torch and numpy take as a size or a count


def param_value(key: str, value: Any, plain: bool = True, label: str = "-p ") -> Any:
    """A workload parameter as the user meant it: YAML 1.1 reads 1e1 and 2e9 (no dot) as strings, yet written
    plain (not quoted) they are numbers: a whole one (1e1 -> 10) where the value is whole, else a float (1e-4)."""
    if plain and isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
        number = float(value)
        if not math.isfinite(number):
            raise InputError(f"{label}{key}={value[:40]}: not a finite number.")
        value = int(number) if number.is_integer() else number
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_PARAM_INT:
        raise InputError(f"{label}{key}={str(value)[:40]}: larger than any workload parameter can use "
                         f"(at most {MAX_PARAM_INT:,}).")
    return value


def parse_params(pairs: list[str] | dict | None) -> dict[str, Any]:
    """--param key=value pairs, values read as YAML scalars (1e-4 -> float, 1e1 -> 10, true -> bool)."""
    if isinstance(pairs, dict):
        return {k: param_value(str(k), v, label="params.") for k, v in pairs.items()}
    out: dict[str, Any] = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise InputError(f"--param {pair!r} must be key=value.")
        key, value = pair.split("=", 1)
        key = key.strip()
        if not value.strip():
            out[key] = ""
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            parsed = value
        out[key] = param_value(key, parsed, plain=value.strip() == parsed)  # '1e1' quoted stays a string
    return out


@dataclass
class GridSpec:
    workload: str = "builtin:gpt"
    params: dict | None = None
    micro_batch: list[int] | None = None
    seq_len: list[int] | None = None
    eval_seq_len: list[int] | None = None
    eval_micro_batch: int | None = None
    precision: list[str] | None = None
    checkpointing: list[bool] | None = None
    optimizer: list[str] | None = None
    grad_accum: list[int] | None = None
    effective_batch: int | None = None
    steady_updates: int = 3
    lr: float = 1e-4
    cap: str = ""
    cap_bytes: int | None = None
    device: str = "cpu"
    mode: str = "measured"
    strategy: str = "single"
    nproc: int = 1
    targets: list[str] | None = None  # estimates: kernel targets (planner/models/kernels.py); None: the CPU's kernels


def build_grid(spec: GridSpec) -> list[ProbeConfig]:
    """Cartesian product of the lists. eval_seq_len defaults to seq_len; grad_accum from effective_batch."""
    micro = spec.micro_batch or [1]
    seqs = spec.seq_len or [128]
    precisions = [canonical_precision(p) for p in spec.precision or ["fp32"]]
    for p in precisions:
        if p not in PRECISIONS:
            raise InputError(f"precision {p!r} is not one of {', '.join(PRECISIONS)}.")
    optimizers = spec.optimizer or ["adamw"]
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise InputError(f"optimizer {o!r} is not one of {', '.join(OPTIMIZERS)}.")
    if spec.steady_updates < 3:
        raise InputError("steady_updates must be at least 3 (the median needs a few timed updates).")
    if spec.strategy not in ("single", "ddp", "fsdp"):
        raise InputError(f"strategy {spec.strategy!r} is not one of single, ddp, fsdp.")
    if (spec.strategy == "single") != (spec.nproc == 1):
        raise InputError("--strategy ddp|fsdp needs --nproc N >= 2 (and --nproc > 1 needs a strategy).")
    if spec.mode == "estimated" and spec.strategy == "ddp":
        raise InputError("DDP estimates are not needed: a DDP rank holds what one process holds (estimate without "
                         "--strategy) plus one gradient-sized bucket set; estimate --strategy fsdp --nproc N shards.")
    if spec.effective_batch and spec.grad_accum:
        raise InputError("give --effective-batch or --grad-accum, not both (one determines the other).")
    targets = spec.targets or [""]
    for t in targets:
        if t and t not in TARGETS:
            raise InputError(f"kernel target {t!r} is not one of {', '.join(TARGETS)}.")
    if spec.mode != "estimated" and targets != [""]:
        raise InputError("--target is for estimates: a probe runs the kernels of the device it runs on.")
    configs = []
    for mb, seq, prec, ckpt, opt, target in itertools.product(micro, seqs, precisions, spec.checkpointing or [False],
                                                              optimizers, targets):
        if target == "sm50-75" and prec == "bf16":
            prec = "fp16"  # no bf16 before sm80: these GPUs run fp16 with a scaler (as the planner plans them)
        if target == "sm50-75" and prec == "bf16-true":
            prec = "fp32"  # and bf16-true runs fp32 there (planner/select.choose_precision)
        if spec.effective_batch:
            per_step = mb * spec.nproc  # data replicas multiply the examples per update
            if spec.effective_batch % per_step:
                raise InputError(
                    f"effective batch {spec.effective_batch} is not divisible by micro-batch {mb}"
                    f"{f' × {spec.nproc} ranks' if spec.nproc > 1 else ''}: grad_accum would not be whole, and "
                    f"the examples per update would change. Use micro-batches that divide it.")
            accums = [spec.effective_batch // per_step]
        else:
            accums = spec.grad_accum or [1]
        for acc in accums:
            for eval_seq in spec.eval_seq_len or [seq]:
                configs.append(ProbeConfig(
                    workload=spec.workload, params_json=json.dumps(spec.params or {}, sort_keys=True),
                    micro_batch=mb, seq_len=seq, eval_seq_len=eval_seq, eval_micro_batch=spec.eval_micro_batch or mb,
                    grad_accum=acc, precision=prec, checkpointing=ckpt, optimizer=opt, lr=spec.lr,
                    steady_updates=spec.steady_updates, cap=spec.cap, cap_bytes=spec.cap_bytes, device=spec.device,
                    mode=spec.mode, strategy=spec.strategy, world_size=spec.nproc, target=target))
    return list(dict.fromkeys(configs))


def load_grid_file(path: str) -> dict[str, Any]:
    """A probe YAML file: the same keys as the options (lists or comma strings)."""
    data = load_yaml_file(path, "probe grid")
    problems = Problems(str(path))
    if not isinstance(data, dict):
        problems.add("", "must be a mapping of option names to values")
        problems.raise_if_any()
    validate(GridEntry, data, problems, "")  # types and bounds by key, in the file's own terms
    problems.raise_if_any()
    return data


DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def checked_device(device: str) -> str:
    """auto | cpu | cuda | cuda:N, as spelled; whether this machine has it is the command's check (cli)."""
    if not DEVICE.fullmatch(str(device)):
        raise InputError(f"--device {device!r} must be auto, cpu, cuda or cuda:N.")
    return str(device)


def checked_count(name: str, value, lo: int = 1, hi: int = 1 << 20) -> int | None:
    """An optional whole number given on the command line or in a grid file, within [lo, hi]."""
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a whole number, got {value!r}.") from None
    if isinstance(value, bool) or not v.is_integer() or not lo <= v <= hi:
        raise InputError(f"{name} must be a whole number from {lo} to {hi:,}, got {value!r}.")
    return int(v)


MIN_CAP = 1 << 20


def resolve_cap(cap: str | None, catalog_path: str | None) -> tuple[str, int | None]:
    """--cap GPU_ID (catalog usable memory less the CUDA context) or --cap SIZE (e.g. 300MiB)."""
    if not cap:
        return "", None
    try:
        size = parse_size(cap)
    except ValueError as e:
        raise InputError(f"--cap {cap[:40]}: not a size a device has ({e.args[0]}); give a GPU id from "
                         "`rentplan catalog list` or a size such as 24GiB.") from None
    if size is not None:
        if size < MIN_CAP:
            raise InputError(f"--cap {cap}: a cap below {MIN_CAP >> 20} MiB holds no model; give a GPU id from "
                             "`rentplan catalog list` or a size such as 24GiB.")
        return cap, size
    catalog = load_catalog(catalog_path)
    gpu = catalog.gpu(cap)
    return gpu.id, gpu.usable_bytes - catalog.context_bytes


# The options a grid reads: `rentplan probe`'s and `estimate`'s grid options, by their Python names.
GRID_KEYS = frozenset({
    "cap", "catalog_path", "checkpointing", "data", "device", "effective_batch", "eval_micro_batch", "eval_seq_len",
    "fields", "grad_accum", "grid_file", "lora", "lr", "micro_batch", "nproc", "on_truncate", "optimizer", "params",
    "precision", "quantize", "seq_len", "steady_updates", "strategy", "val_data", "workload"})


def spec_from_options(o: dict) -> GridSpec:
    unknown = sorted(set(o) - GRID_KEYS)
    if unknown:  # a misspelt option from Python would otherwise leave its default in place, unsaid
        import difflib

        near = {k: difflib.get_close_matches(k, sorted(GRID_KEYS), 1) for k in unknown}
        raise InputError("unknown grid option(s): " + ", ".join(
            f"{k!r}" + (f" (did you mean {near[k][0]!r}?)" if near[k] else "") for k in unknown)
            + f". The options are {', '.join(sorted(GRID_KEYS))}.")
    data = load_grid_file(o["grid_file"]) if o.get("grid_file") else {}

    def pick(key):
        v = o.get(key)
        return v if v not in (None, ()) else data.get(key)

    cap_label, cap_bytes = resolve_cap(pick("cap"), o.get("catalog_path"))
    params = parse_params(data.get("params")) if data.get("params") else {}
    given = o.get("params") or []
    params.update(parse_params(given if isinstance(given, dict) else list(given)))
    for key in ("lora", "quantize", "data", "fields", "val_data", "on_truncate"):  # the hf: workload's params
        if o.get(key):
            params[key] = o[key]
    return GridSpec(
        workload=pick("workload") or "builtin:gpt", params=params,
        micro_batch=parse_list(pick("micro_batch"), positive_int, "--micro-batch"),
        seq_len=parse_list(pick("seq_len"), positive_int, "--seq-len"),
        eval_seq_len=parse_list(pick("eval_seq_len"), positive_int, "--eval-seq-len"),
        eval_micro_batch=checked_count("--eval-micro-batch", pick("eval_micro_batch")),
        precision=parse_list(pick("precision"), str, "--precision"),
        checkpointing=parse_list(pick("checkpointing"), on_off, "--checkpointing"),
        optimizer=parse_list(pick("optimizer"), str, "--optimizer"),
        grad_accum=parse_list(pick("grad_accum"), positive_int, "--grad-accum"),
        effective_batch=checked_count("--effective-batch", pick("effective_batch")),
        steady_updates=checked_count("--steady-updates", pick("steady_updates"), 3, 10_000) or 3,
        lr=checked_lr(pick("lr")), cap=cap_label, cap_bytes=cap_bytes,
        device=checked_device(pick("device") or "auto"),
        strategy=pick("strategy") or "single", nproc=checked_count("--nproc", pick("nproc"), 1, 1024) or 1)


def checked_lr(value) -> float:
    if value is None:
        return 1e-4
    try:
        lr = float(value)
    except (TypeError, ValueError):
        raise InputError(f"--lr must be a number, got {value!r}.") from None
    if not 0 < lr < float("inf"):
        raise InputError(f"--lr must be a positive number, got {value!r}.")
    return lr


def checked_timeout(timeout_s: float) -> float:
    if not 0 < timeout_s <= 7 * 24 * 3600:
        raise InputError(f"--timeout must be a number of seconds above 0 (at most a week), got {timeout_s:g}.")
    return timeout_s


def resolve_targets(text: str, catalog_path: str | None) -> list[str]:
    """--target: kernel targets (sm80+, sm50-75, cpu), catalog GPU ids (their target), or all (every target the
    catalog's GPUs need)."""
    out = []
    for item in parse_list(text, str, "--target"):
        if item in TARGETS:
            out.append(item)
            continue
        catalog = load_catalog(catalog_path)
        if item == "all":
            out += sorted({kernel_target(g.compute_capability, g.software) for g in catalog.gpus.values()})
        else:
            g = catalog.gpu(item)
            out.append(kernel_target(g.compute_capability, g.software))
    return list(dict.fromkeys(out))
