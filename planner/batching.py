"""Batch arithmetic: examples per update, updates per pass, the last partial batch. No torch.

Data replicas (DDP/FSDP ranks) multiply the examples per update; model parallelism does not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from planner.errors import InputError


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    grad_accum: int
    replicas: int
    examples_per_update: int
    examples: int | None = None
    updates_per_pass: int | None = None
    full_updates: int | None = None
    last_update_examples: int | None = None  # examples in a last partial update (0 = none)
    dropped_examples: int | None = None
    tokens_per_update: int | None = None
    last_update_normalised_by: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def batch_plan(micro_batch: int, grad_accum: int, replicas: int = 1, examples: int | None = None,
               seq_len: int | None = None, drop_last: bool = False) -> BatchPlan:
    for name, v in (("micro_batch", micro_batch), ("grad_accum", grad_accum), ("replicas", replicas)):
        if v < 1:
            raise InputError(f"{name} must be >= 1, got {v}.")
    per_update = micro_batch * grad_accum * replicas
    tokens = per_update * seq_len if seq_len else None
    if examples is None:
        return BatchPlan(micro_batch, grad_accum, replicas, per_update, tokens_per_update=tokens)
    full, rest = divmod(examples, per_update)
    if rest and not drop_last:
        updates, last, dropped = full + 1, rest, 0
        how = (f"the last update sees {rest} examples; its loss is the mean over the targets it really has "
               f"(normalised by its own count, not by {per_update})")
    else:
        updates, last, dropped = full, 0, rest
        how = f"{rest} examples dropped (--drop-last)" if rest else "no partial update"
    return BatchPlan(micro_batch, grad_accum, replicas, per_update, examples, updates, full, last, dropped, tokens, how)


def _examples_seen(bp: BatchPlan, n_updates: int) -> int:
    """Examples n_updates see, pass after pass: full updates hold examples_per_update, each pass's last partial
    update its remainder (none with --drop-last)."""
    if not bp.examples or not bp.updates_per_pass:
        return n_updates * bp.examples_per_update
    full, last = bp.full_updates or 0, bp.last_update_examples or 0  # both set with examples (batch_plan)
    passes, rest = divmod(n_updates, bp.updates_per_pass)
    per_pass = full * bp.examples_per_update + last
    partial = min(rest, full) * bp.examples_per_update + (last if rest > full else 0)
    return passes * per_pass + partial


def accumulation_for(effective_batch: int, micro_batch: int, replicas: int = 1) -> int:
    """grad_accum that keeps the effective batch; refuses when it would not be whole."""
    per_step = micro_batch * replicas
    if effective_batch % per_step:
        raise InputError(f"effective batch {effective_batch} is not divisible by micro-batch {micro_batch} × "
                         f"{replicas} replica(s) = {per_step}; accumulation would not be whole.")
    return effective_batch // per_step


def largest_micro_batch(effective_batch: int, replicas: int, limit: int) -> int | None:
    """Largest micro-batch <= limit that divides the per-replica share of the effective batch."""
    if effective_batch % replicas:
        return None
    share = effective_batch // replicas
    for mb in range(min(limit, share), 0, -1):
        if share % mb == 0:
            return mb
    return None


def _parse_setting(text: str) -> dict[str, int]:
    out = {}
    for part in text.split(","):
        if "=" not in part:
            raise InputError(f"--compare {text!r}: use micro=4,accum=4[,replicas=2].")
        word, v = part.split("=", 1)
        k = {"micro": "micro_batch", "micro_batch": "micro_batch", "accum": "grad_accum", "grad_accum": "grad_accum",
             "replicas": "replicas"}.get(word.strip())
        if k is None:
            raise InputError(f"--compare {text!r}: keys are micro, accum, replicas.")
        if k in out:
            raise InputError(f"--compare {text!r}: {part.split('=')[0].strip()} is given twice.")
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = 0
        if not 1 <= out[k] <= 1 << 20:
            raise InputError(f"--compare {text!r}: {part.strip()[:40]!r} must be a whole number from 1 to 1,048,576.")
    return out


def compare_settings(micro_batch: int, grad_accum: int, replicas: int, other: str, hold: str,
                     examples: int | None, updates: int | None, seq_len: int | None, drop_last: bool = False):
    """Two settings side by side: what stays fixed and what changes under --hold updates|epochs. Examples seen
    count what each update really holds (a last partial update its own examples; --drop-last drops them)."""
    import pandas as pd

    b = {"micro_batch": micro_batch, "grad_accum": grad_accum, "replicas": replicas}
    o = {**b, **_parse_setting(other)}
    rows = []
    for name, s in (("current", b), ("compare", o)):
        bp = batch_plan(s["micro_batch"], s["grad_accum"], s["replicas"], examples, seq_len, drop_last)
        if hold == "updates":
            base = batch_plan(**b, examples=examples, drop_last=drop_last) if examples else None
            n_updates = updates or (base.updates_per_pass if base else None)
        else:
            n_updates = bp.updates_per_pass
        seen = _examples_seen(bp, n_updates) if n_updates else None
        rows.append({"setting": name, **s, "examples_per_update": bp.examples_per_update, "updates": n_updates,
                     "examples_seen": seen, "passes": round(seen / examples, 3) if seen and examples else None})
    df = pd.DataFrame(rows)
    fixed = "updates" if hold == "updates" else "passes over the data"
    changes = [c for c in ("examples_per_update", "updates", "examples_seen") if df[c].nunique(dropna=False) > 1]
    df.attrs["summary"] = f"held fixed: {fixed}; changes: {', '.join(changes) or 'nothing'}"
    return df
