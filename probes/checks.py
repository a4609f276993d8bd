"""Pilot checks that run before any money is spent, on the same Trainer the probes use:
inspect (what the loss really sees), overfit (a tiny subset is learned), resume-check (exact resume).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field

import torch

from planner.records import ProbeConfig
from probes import checkpoint
from probes.builtin import IGNORE
from probes.loop import Trainer, count_targets
from probes.runner import call_in_worker
from probes.workloads import load_workload

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    if not values:
        return ""
    step = max(1, math.ceil(len(values) / width))
    pts = [values[i] for i in range(0, len(values), step)]
    finite = [v for v in pts if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    span = (hi - lo) or 1.0
    return "".join(SPARK[int((v - lo) / span * (len(SPARK) - 1))] if math.isfinite(v) else "!" for v in pts)


def _config(ref: str, params: dict, **kw) -> ProbeConfig:
    return ProbeConfig(workload=ref, params_json=json.dumps(params, sort_keys=True), **kw)


# ------------------------------------------------------------------------------------------------ inspect

@dataclass
class InspectReport:
    examples: list[dict[str, str]]
    counted: int
    positions: int | None
    n_outputs: int | None  # the class or vocabulary axis' width (None where the output has none)
    warnings: list[str] = field(default_factory=list)
    class_names: list[str] | None = None
    task: str = "other"  # classification | causal-lm | other (see model_task)
    output_shape: tuple[int, ...] | None = None  # one example's output


TASKS = {"classification": "classification", "causal-lm": "causal LM",
         "other": "image or other (no class or vocabulary axis)"}


def _output_shape(model: torch.nn.Module, workload, batch: dict) -> tuple[int, ...] | None:
    """Shape of the model's output (a tensor, or a Hugging Face output's logits), seen by a forward hook during
    compute_loss."""
    seen: list[tuple[int, ...]] = []

    def hook(m, i, o):
        o = getattr(o, "logits", o)
        o = o[0] if isinstance(o, (tuple, list)) and o and torch.is_tensor(o[0]) else o
        if torch.is_tensor(o):
            seen.append(tuple(o.shape))

    handle = model.register_forward_hook(hook)
    try:
        with torch.no_grad():
            workload.compute_loss(model, batch)
    except Exception:  # noqa: BLE001  out-of-range labels make the loss itself fail: reported separately
        pass
    finally:
        handle.remove()
    return seen[-1] if seen else None


def model_task(workload, labels, shape: tuple[int, ...] | None) -> str:
    """What the model learns, before any warning that depends on it: the workload's own `task` (hf: workloads
    read it from the config's architecture), else the shapes: integer labels one per example beside an output of
    (batch, classes) is classification; integer labels per position beside (batch, positions, vocabulary) is a
    causal LM; anything else (images, regression, ...) is other, with no class or vocabulary axis."""
    said = getattr(workload, "task", None)
    if said in TASKS:
        return said
    integer = torch.is_tensor(labels) and not labels.is_floating_point() and not labels.is_complex()
    if integer and shape is not None and labels.dim() == 1 and len(shape) == 2:
        return "classification"
    if integer and shape is not None and labels.dim() == 2 and len(shape) == 3 and labels.shape == shape[:2]:
        return "causal-lm"
    return "other"


def inspect_workload(ref: str, params: dict, n: int = 3, split: str = "train", seq_len: int = 32,
                     index: int = 0) -> InspectReport:
    workload = load_workload(ref, params)
    batch = workload.make_batch(split, index, n, seq_len)
    model = workload.build_model()
    model.eval()
    shown = workload.show(batch) if hasattr(workload, "show") else [
        {k: str(v[i].tolist()) for k, v in batch.items() if torch.is_tensor(v) and v.shape[:1] == (n,)}
        for i in range(n)]
    counted = count_targets(workload, batch)
    labels, mask = batch.get("labels"), batch.get("attention_mask")
    positions = int(labels.numel()) if torch.is_tensor(labels) else None
    warnings = []
    if counted == 0:
        warnings.append("no counted target in this batch: the loss sees nothing (all labels masked?)")
    if torch.is_tensor(labels) and torch.is_tensor(mask) and labels.shape == mask.shape:
        pad_counted = int(((mask == 0) & (labels != IGNORE)).sum())
        if pad_counted:
            warnings.append(f"padding counted in the loss: {pad_counted} padded positions have a label "
                            "(set them to -100)")
    shape = _output_shape(model, workload, batch)
    task = model_task(workload, labels, shape)
    # the last axis is a class or vocabulary axis only for these tasks (an image's last axis is its width)
    n_out = shape[-1] if shape and task in ("classification", "causal-lm") else None
    if torch.is_tensor(labels) and n_out is not None:
        real = labels[labels != IGNORE]
        bad = real[(real < 0) | (real >= n_out)]
        if bad.numel():
            warnings.append(f"label ids outside the model's output range 0..{n_out - 1}: "
                            f"{sorted(set(bad.tolist()))[:8]}")
    names = getattr(workload, "class_names", None)
    if names is not None and n_out is not None and len(names) != n_out:
        warnings.append(f"class_names has {len(names)} names but the model has {n_out} outputs")
    if (task == "causal-lm" and getattr(workload, "masks_prompt", False) and torch.is_tensor(labels)
            and not bool((labels == IGNORE).any())):
        warnings.append("the workload says prompt tokens are masked, but every position is counted in the loss")
    return InspectReport(shown, counted, positions, n_out, warnings, names, task,
                         None if shape is None else shape[1:])


# ------------------------------------------------------------------------------------------------ overfit

@dataclass
class OverfitReport:
    losses: list[float]
    passed: bool
    failures: list[str]
    recovered: tuple[int, int] | None  # (right, total) target ids recovered by predict()


def overfit(ref: str, params: dict, examples: int = 8, updates: int = 100, lr: float = 3e-3, seq_len: int = 32,
            max_ratio: float = 0.10, device: str = "cpu") -> OverfitReport:
    """Train on one fixed tiny batch. Checks the mechanism (the loop can fit data), not generalisation."""
    torch.manual_seed(0)
    workload = load_workload(ref, params)
    cfg = _config(ref, params, micro_batch=examples, seq_len=seq_len, lr=lr, device=device)
    trainer = Trainer(workload, cfg, torch.device(device))
    losses: list[float] = []
    failures: list[str] = []
    for _ in range(updates):
        try:
            res = trainer.train_update([0])  # the same micro-batch every time
        except RuntimeError as e:
            failures.append(f"update {trainer.update + 1} failed: {e}")
            break
        losses.append(res.loss)
    if not failures and not all(math.isfinite(x) for x in losses):
        failures.append("a loss was not finite")
    if losses and losses[0] > 0 and not losses[-1] <= max_ratio * losses[0]:
        failures.append(f"final loss {losses[-1]:.4g} is not <= {max_ratio:.0%} of the first ({losses[0]:.4g})")
    recovered = None
    if hasattr(workload, "predict") and not failures:
        trainer.model.eval()
        with torch.no_grad():
            pred, target = workload.predict(trainer.model, trainer.batch(0))
        right, total = int((pred == target).sum()), int(target.numel())
        recovered = (right, total)
        if right != total:
            failures.append(f"predict() recovers {right} of {total} target ids of the subset")
    return OverfitReport(losses, not failures, failures, recovered)


# ------------------------------------------------------------------------------------------- resume-check

def _fingerprint(batch: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        v = batch[k]
        if torch.is_tensor(v):
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _trace_update(trainer: Trainer, stop_after: int | None = None) -> dict | None:
    indices = list(range(trainer.position, trainer.position + trainer.cfg.grad_accum)) \
        if trainer.window is None else trainer.window["indices"]
    prints = [_fingerprint(trainer.batch(i)) for i in indices]
    res = trainer.train_update(None if trainer.window else indices, stop_after=stop_after)
    if res is None:
        return None
    return {"update": trainer.update, "lr": trainer.lr(), "indices": indices, "batches": prints, "loss": res.loss,
            "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]}


def _final_state(trainer: Trainer) -> dict:
    opt = trainer.optimizer.state_dict()["state"]
    return {"params": {k: v.detach().cpu().clone() for k, v in trainer.model.state_dict().items()},
            "optimizer": {f"{i}.{k}": v.detach().cpu().clone() for i, s in opt.items() for k, v in s.items()
                          if torch.is_tensor(v)},
            "scaler": trainer.scaler.state_dict() if trainer.scaler else None}


def resume_worker(mode: str, cfg_dict: dict, ckpt: str, updates: int, at: int, at_micro: int) -> dict:
    """Runs in a fresh worker process. mode: full (A) | stop (B: save at the point, exit) | resume (C)."""
    torch.manual_seed(1234)
    cfg = ProbeConfig(**cfg_dict)
    workload = load_workload(cfg.workload, json.loads(cfg.params_json))
    trainer = Trainer(workload, cfg, torch.device(cfg.device))
    trace = []
    if mode == "resume":
        checkpoint.load(trainer, ckpt)
        start = {"update": trainer.update, "lr": trainer.lr(), "position": trainer.position,
                 "window_done": trainer.window["done"] if trainer.window else 0}
    else:
        start = None
    while trainer.update < updates:
        stopping = mode == "stop" and trainer.update == at
        if stopping and not at_micro:
            break
        t = _trace_update(trainer, stop_after=at_micro if stopping else None)
        if t is None:  # stopped inside the window
            break
        trace.append(t)
    if mode == "stop":
        checkpoint.save(trainer, ckpt)
        return {"trace": trace}
    return {"trace": trace, "start": start, "final": _final_state(trainer)}


@dataclass
class ResumeReport:
    passed: bool
    differences: list[str]
    compared_updates: list[int]
    losses_a: list[float]
    losses_c: list[float]


def _tensors_equal(a: dict, b: dict) -> list[str]:
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])]


def compare_runs(a: dict, c: dict, at: int, at_micro: int) -> list[str]:
    diffs = []
    after = [t for t in a["trace"] if t["update"] > at]
    cont = c["trace"]
    if c["start"]["update"] != at:
        diffs.append(f"step: resumed at update {c['start']['update']}, expected {at}")
    lr_at = next((t["lr"] for t in a["trace"] if t["update"] == at), None)
    if lr_at is not None and c["start"]["lr"] != lr_at:
        diffs.append(f"LR: {c['start']['lr']:.6g} after resume, {lr_at:.6g} in the uninterrupted run")
    if at_micro and c["start"]["window_done"] != at_micro:
        diffs.append(f"data position: resumed {c['start']['window_done']} micro-batches into the window, "
                     f"expected {at_micro}")
    if len(cont) != len(after):
        diffs.append(f"step: {len(cont)} updates after resume, expected {len(after)}")
    for ta, tc in zip(after, cont):
        u = ta["update"]
        if ta["update"] != tc["update"]:
            diffs.append(f"step: update {tc['update']} where {u} was expected")
        if ta["indices"] != tc["indices"]:
            diffs.append(f"data position: update {u} read micro-batches {tc['indices']}, expected {ta['indices']}")
        elif ta["batches"] != tc["batches"]:
            diffs.append(f"data position: update {u} got different data for the same indices {ta['indices']}: "
                         "make_batch must depend only on (split, index), not keep its own counter")
        if ta["lr"] != tc["lr"]:
            diffs.append(f"LR: update {u} used {tc['lr']:.6g}, expected {ta['lr']:.6g}")
        if ta["loss"] != tc["loss"]:
            diffs.append(f"loss: update {u} {tc['loss']!r} vs {ta['loss']!r} uninterrupted")
        if ta["rng"] != tc["rng"]:
            diffs.append(f"RNG: torch RNG state differs after update {u}")
    fa, fc = a["final"], c["final"]
    if bad := _tensors_equal(fa["params"], fc["params"]):
        diffs.append(f"parameters differ at the end: {', '.join(bad[:4])}")
    if bad := _tensors_equal(fa["optimizer"], fc["optimizer"]):
        diffs.append(f"optimizer state differs at the end: {', '.join(bad[:4])}")
    if fa["scaler"] != fc["scaler"]:
        diffs.append("scaler state differs at the end")
    kinds: dict[str, list[str]] = {}
    for d in diffs:  # report each kind once (its first occurrence) with how often it happened
        kinds.setdefault(d.split(":", 1)[0], []).append(d)
    return [v[0] + (f" (and {len(v) - 1} more)" if len(v) > 1 else "") for v in kinds.values()]


def resume_hash_seed() -> int:
    """A hash seed other than this process's (PYTHONHASHSEED unset or random counts as 0 here)."""
    mine = os.environ.get("PYTHONHASHSEED", "")
    return 2 if mine == "1" else 1


def resume_check(ref: str, params: dict, updates: int = 10, at: int = 5, at_micro: int = 0, grad_accum: int = 1,
                 micro_batch: int = 2, seq_len: int = 32, precision: str = "fp32", device: str = "cpu",
                 timeout_s: float = 600) -> ResumeReport:
    """A uninterrupted; B stops at `at` (+at_micro micro-batches) and saves; C loads it in a fresh process."""
    if not 0 < at < updates:
        raise ValueError(f"--at must be between 1 and {updates - 1}")
    if not 0 <= at_micro < grad_accum:
        raise ValueError(f"--at-micro must be below grad_accum ({grad_accum})")
    cfg = dataclasses.asdict(_config(ref, params, micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum,
                                     precision=precision, device=device, lr=1e-3))
    with tempfile.TemporaryDirectory(prefix="rentplan-resume-") as tmp:
        ckpt = os.path.join(tmp, "resume.ckpt.pt")
        a = call_in_worker(resume_worker, ("full", cfg, ckpt, updates, at, at_micro), timeout_s)
        call_in_worker(resume_worker, ("stop", cfg, ckpt, updates, at, at_micro), timeout_s)
        # The resumed half runs in a newly started interpreter with another hash seed, as a real restart
        # would: batches seeded from hash() (which changes between processes) then show up as a difference.
        c = call_in_worker(resume_worker, ("resume", cfg, ckpt, updates, at, at_micro), timeout_s,
                           env={"PYTHONHASHSEED": str(resume_hash_seed())})
    diffs = compare_runs(a, c, at, at_micro)
    if any(d.startswith("batch") or "data" in d for d in diffs):
        diffs.append(f"the resumed half ran in a new interpreter with PYTHONHASHSEED={resume_hash_seed()}: a "
                     "make_batch seeded from hash() (or iterating a set of strings) changes between processes; "
                     "seed from zlib.crc32(f'{split}:{index}'.encode()) instead")
    return ResumeReport(not diffs, diffs, [t["update"] for t in c["trace"]],
                        [t["loss"] for t in a["trace"] if t["update"] > at], [t["loss"] for t in c["trace"]])
