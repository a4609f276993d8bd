"""Memory model per phase: bytes = a + b·(micro_batch·seq_len) + c·(micro_batch·seq_len²), fit to lines.

Each phase's figure is the reserved peak where the device has one (CUDA, measured), else the allocated
peak × a fragmentation factor (CPU or estimated lines): allocated and reserved are never added.
With fewer than 3 distinct points the model falls back to a + b·tokens through the phase's baseline
(what was live before it). Predictions outside the measured range are flagged `extrapolated`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from planner.records import PHASES

EVAL_PHASES = {"eval"}
MB_LIMIT, SEQ_LIMIT = 4096, 1 << 20  # where the max-dimension searches stop: at the limit means "at least"


@dataclass(frozen=True)
class Point:
    micro_batch: int
    seq_len: int
    bytes: float
    baseline: float | None = None


@dataclass
class PhaseFit:
    phase: str
    kind: str  # fit3 | linear | constant, optionally "floor+" (max of a floor line and the activation fit)
    coef: tuple[float, float, float]
    points: list[Point]
    max_rel_error: float = 0.0  # on the points it was fit to
    floor: tuple[float, float] | None = None  # f0 + f1·tokens: the peak that does not grow with activations

    def predict(self, micro_batch: int, seq_len: int) -> float:
        a, b, c = self.coef
        t = micro_batch * seq_len
        act = a + b * t + c * t * seq_len
        if self.floor is None:
            return act
        return max(act, self.floor[0] + self.floor[1] * t)

    def in_range(self, micro_batch: int, seq_len: int) -> bool:
        mbs = [p.micro_batch for p in self.points]
        seqs = [p.seq_len for p in self.points]
        return min(mbs) <= micro_batch <= max(mbs) and min(seqs) <= seq_len <= max(seqs)


def _poly(points: list[Point]) -> tuple[np.ndarray, str]:
    """a + b·t + c·t·s with as many terms as the distinct points allow; slopes never negative."""
    distinct = {(p.micro_batch, p.seq_len) for p in points}
    y = np.array([p.bytes for p in points], dtype=float)
    t = np.array([p.micro_batch * p.seq_len for p in points], dtype=float)
    s = np.array([p.seq_len for p in points], dtype=float)
    if len(distinct) >= 3:
        X = np.stack([np.ones_like(t), t, t * s], axis=1)
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        if coef[2] < 0 or coef[1] < 0:  # memory never shrinks with more tokens: refit without that term
            cols = [0, 1] if coef[2] < 0 else [0, 2]
            c2, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            coef = np.zeros(3)
            coef[cols] = c2
        return np.maximum(coef, [-np.inf, 0, 0]), "fit3"
    if len(distinct) == 2:
        (m1, s1), (m2, s2) = sorted(distinct)
        y1 = np.mean([p.bytes for p in points if (p.micro_batch, p.seq_len) == (m1, s1)])
        y2 = np.mean([p.bytes for p in points if (p.micro_batch, p.seq_len) == (m2, s2)])
        t1, t2 = m1 * s1, m2 * s2
        slope = max(0.0, (y2 - y1) / (t2 - t1)) if t2 != t1 else 0.0
        return np.array([y1 - slope * t1, slope, 0.0]), "linear"
    p = points[0]
    base = p.baseline if p.baseline is not None else p.bytes
    slope = max(0.0, (p.bytes - base) / (p.micro_batch * p.seq_len))
    return np.array([p.bytes - slope * p.micro_batch * p.seq_len, slope, 0.0]), "linear" if slope else "constant"


def _floor(points: list[Point]) -> tuple[float, float]:
    t = np.array([p.micro_batch * p.seq_len for p in points], dtype=float)
    y = np.array([p.bytes for p in points], dtype=float)
    if len(set(t)) < 2:
        return float(y.max()), 0.0
    f1, f0 = np.polyfit(t, y, 1)
    return float(f0), float(max(f1, 0.0))


def _errors(fit: PhaseFit) -> float:
    errs = [abs(fit.predict(p.micro_batch, p.seq_len) - p.bytes) / p.bytes for p in fit.points if p.bytes > 0]
    return max(errs) if errs else 0.0


def _three(coef) -> tuple[float, float, float]:
    """a, b, c of a + b·t + c·t·s (_poly always gives three)."""
    a, b, c = (float(x) for x in coef)
    return a, b, c


def fit_phase(phase: str, points: list[Point]) -> PhaseFit:
    """A single activation fit, or max(floor, activation fit) where the phase's peak has two regimes (e.g. the
    optimizer step's fixed peak at small sizes, the backward pass's at large ones): the lower error wins."""
    coef, kind = _poly(points)
    best = PhaseFit(phase, kind, _three(coef), points)
    best.max_rel_error = _errors(best)
    ordered = sorted(points, key=lambda p: p.bytes)
    for k in range(1, len(ordered) - 1):
        low, high = ordered[:k], ordered[k:]
        if len({(p.micro_batch, p.seq_len) for p in high}) < 2:
            continue
        c2, k2 = _poly(high)
        cand = PhaseFit(phase, f"floor+{k2}", _three(c2), points, floor=_floor(low))
        cand.max_rel_error = _errors(cand)
        if cand.max_rel_error < best.max_rel_error - 1e-6:
            best = cand
    return best


FIT_WORDS = {"fit3": "a + b·tokens + c·tokens·seq_len (least squares)", "linear": "a line in tokens",
             "constant": "a constant"}


def describe_fit(fit: PhaseFit) -> str:
    """The fit in words, and whether its points test it: a fit with as many terms as distinct points passes
    through them exactly, so an error on them says nothing."""
    kind = fit.kind.replace("floor+", "")
    words = FIT_WORDS.get(kind, kind) + (" above a fixed floor" if fit.kind.startswith("floor+") else "")
    distinct = len({(p.micro_batch, p.seq_len) for p in fit.points})
    terms = sum(1 for c in fit.coef if c != 0.0) + (2 if fit.floor is not None else 0)
    if distinct <= max(terms, 1):
        return f"{words} through {distinct} point(s), exact by construction: not validated"
    return f"{words} on {len(fit.points)} points (max error on them {fit.max_rel_error:.2%})"


@dataclass
class Need:
    bytes: float
    phase: str
    basis: str
    extrapolated: bool
    per_phase: dict[str, float] = field(default_factory=dict)


@dataclass
class MemoryModel:
    """Fits for every phase of one configuration family (workload, params, precision, optimizer, ckpt)."""

    fits: dict[str, PhaseFit]
    basis: str  # e.g. "reserved, measured on cuda (NVIDIA H200)"
    measured_exact: dict[tuple, dict[str, float]]  # (mb, seq, eval_mb, eval_seq) -> phase -> bytes
    widen: float = 1.0  # an estimate found short of a measurement of its own (planner/decisions/selfcheck.py)
    widen_note: str = ""

    def need(self, micro_batch: int, seq_len: int, eval_micro_batch: int, eval_seq_len: int) -> Need:
        key = (micro_batch, seq_len, eval_micro_batch, eval_seq_len)
        per_phase, extrapolated = {}, False
        exact = self.measured_exact.get(key)
        for phase, fit in self.fits.items():
            mb, s = (eval_micro_batch, eval_seq_len) if phase in EVAL_PHASES else (micro_batch, seq_len)
            if exact and phase in exact:
                per_phase[phase] = exact[phase]
                continue
            per_phase[phase] = max(0.0, fit.predict(mb, s))
            extrapolated |= not fit.in_range(mb, s)
        if self.widen != 1.0:
            per_phase = {ph: b * self.widen for ph, b in per_phase.items()}
        phase = max(per_phase, key=lambda ph: per_phase[ph])
        fit = self.fits[phase]
        distinct = len({(p.micro_batch, p.seq_len) for p in fit.points})
        how = "measured at this configuration" if exact else (
            f"{'extrapolated' if extrapolated else 'interpolated'} from one point (a line through its baseline): "
            "not validated" if distinct < 2 else
            f"{'extrapolated' if extrapolated else 'interpolated'} by {describe_fit(fit)}")
        widened = f"; {self.widen_note}" if self.widen_note else ""
        return Need(per_phase[phase], phase, f"{self.basis}; {how}{widened}", extrapolated and not exact, per_phase)


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name].astype(float) if name in df else pd.Series(float("nan"), index=df.index)


def phase_bytes(df: pd.DataFrame, fragmentation: float) -> pd.Series:
    """The need rule, the one place it is written: reserved where a CUDA device measured it; else the reserved
    peak simulated by the model of CUDA's caching allocator (planner/models/allocator.py) from the run's own
    allocations; else, for lines written before that model existed, allocated × a flat fragmentation factor
    (the basis then says so). Allocated and reserved are never added."""
    reserved, simulated = _column(df, "peak_reserved_bytes"), _column(df, "simulated_reserved_bytes")
    flat = df["peak_allocated_bytes"].astype(float) * fragmentation
    return reserved.where(reserved.notna(), simulated.where(simulated.notna(), flat))


def has_reserved(df: pd.DataFrame) -> pd.Series:
    """Lines whose need rests on a reserved figure (measured or simulated), not on the flat factor."""
    return _column(df, "peak_reserved_bytes").notna() | _column(df, "simulated_reserved_bytes").notna()


def allocated_factor(df: pd.DataFrame, fragmentation: float) -> pd.Series:
    """Per line, what an allocated figure of it (a baseline, the parameters' bytes) is multiplied by to count
    beside its need: 1 where the need rests on a reserved figure, else the flat factor."""
    return has_reserved(df).map({True: 1.0, False: float(fragmentation)}).astype(float)


def build_model(lines: pd.DataFrame, fragmentation: float) -> MemoryModel | None:
    """lines: ok lines of one configuration family. None when nothing usable is there."""
    ok = lines[lines["verdict"] == "ok"].copy()
    if ok.empty:
        return None
    ok["need_bytes"] = phase_bytes(ok, fragmentation)
    ok = ok[ok["need_bytes"].notna()]
    fits: dict[str, PhaseFit] = {}
    exact: dict = {}
    for phase in PHASES:
        rows = ok[ok["phase"] == phase]
        if rows.empty:
            continue
        mb_col, seq_col = ("eval_micro_batch", "eval_seq_len") if phase in EVAL_PHASES else ("micro_batch", "seq_len")
        factor = allocated_factor(rows, fragmentation)
        points = [Point(int(r[mb_col]), int(r[seq_col]), float(r["need_bytes"]),
                        None if pd.isna(r["baseline_allocated_bytes"]) else
                        float(r["baseline_allocated_bytes"]) * factor[i])
                  for i, r in rows.iterrows()]
        fits[phase] = fit_phase(phase, points)
        for _, r in rows.iterrows():
            key = (int(r["micro_batch"]), int(r["seq_len"]), int(r["eval_micro_batch"]), int(r["eval_seq_len"]))
            exact.setdefault(key, {})[phase] = max(exact.get(key, {}).get(phase, 0.0), float(r["need_bytes"]))
    devices = sorted(set(ok["device"]))
    names = sorted(set(ok["device_name"].fillna("")))
    modes = sorted(set(ok["mode"]))
    targets = sorted({t for t in _text(ok, "target") if t})
    where = (f"fake tensors with {', '.join(targets) or 'CPU'} kernels" if modes == ["estimated"]
             else ", ".join(names) or ", ".join(devices))
    if ok["peak_reserved_bytes"].notna().all():
        basis = f"reserved peak, {'/'.join(modes)} on {', '.join(names) or ', '.join(devices)}"
    elif has_reserved(ok).all():
        basis = (f"reserved peak simulated by a model of CUDA's caching allocator (planner/models/allocator.py) "
                 "replaying "
                 f"the allocations, {'/'.join(modes)} on {where}")
    else:
        basis = (f"allocated peak × {fragmentation:g} (flat factor: these lines carry no reserved figure and no "
                 f"allocator simulation), {'/'.join(modes)} on {where}")
    libraries = sorted({x for x in _text(ok, "libraries") if x})  # the model code the lines ran (HF's moves memory)
    if libraries:
        basis += f", under {'; '.join(libraries)}"
    basis += quantized_layer_basis(_text(ok, "detail"))
    # Only complete configurations count as exact measurements.
    exact = {k: v for k, v in exact.items() if set(v) >= set(fits)}
    return MemoryModel(fits, basis, exact)


TRACED_AS = re.compile(r"4-bit layers traced as bitsandbytes [0-9.]+'s MatMul4Bit")
HELD_INPUTS = "keeps each 4-bit layer's input on its graph node"


def quantized_layer_basis(details: list[str]) -> str:
    """What the lines' traces of 4-bit layers assumed (probes/quantize.py says it on each steady line): the
    bitsandbytes version traced, when not the installed one the libraries name, and the previous step's inputs
    held, which depend on the user's loop and are counted (the larger need)."""
    traced = sorted({m.group(0) for d in details for m in [TRACED_AS.search(d)] if m})
    out = "".join(f"; {t}" for t in traced)
    if any(HELD_INPUTS in d for d in details):
        out += ("; counted: the previous step's 4-bit layer inputs, which bitsandbytes < 0.43.2 keeps while a loop "
                "holds the last step's output (the loop is not traced, so the larger need)")
    return out


def _text(df: pd.DataFrame, name: str) -> list[str]:
    return [str(x) for x in df[name].fillna("")] if name in df else []


def max_micro_batch(model: MemoryModel, seq_len: int, eval_micro_batch: int | None, eval_seq_len: int,
                    budget_bytes: float, limit: int = MB_LIMIT) -> tuple[int, bool]:
    """Largest micro-batch whose need fits the budget at seq_len (0 if none); and whether extrapolated.
    The need never shrinks as the micro-batch grows (slopes are clamped at zero), so: grow, then bisect."""
    def fits(mb: int) -> bool:
        return model.need(mb, seq_len, eval_micro_batch or mb, eval_seq_len).bytes <= budget_bytes

    if not fits(1):
        return 0, False
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # lo fits, hi does not (or is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, model.need(lo, seq_len, eval_micro_batch or lo, eval_seq_len).extrapolated


def max_seq_len(model: MemoryModel, micro_batch: int, budget_bytes: float, limit: int = SEQ_LIMIT,
                multiple: int = 64) -> tuple[int, bool]:
    """Largest seq_len that fits at micro_batch, eval at the same shape: a multiple of `multiple`, or the limit
    itself (a model's position limit need not be a multiple)."""
    def fits(seq: int) -> bool:
        return model.need(micro_batch, seq, micro_batch, seq).bytes <= budget_bytes

    if fits(limit):
        return limit, model.need(micro_batch, limit, micro_batch, limit).extrapolated
    lo, hi = 0, (limit - 1) // multiple
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * multiple):
            lo = mid
        else:
            hi = mid - 1
    seq = lo * multiple
    return seq, bool(seq) and model.need(micro_batch, seq, micro_batch, seq).extrapolated
