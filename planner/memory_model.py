"""Memory model per phase: bytes = a + b·(micro_batch·seq_len) + c·(micro_batch·seq_len²), fit to lines.

Each phase's figure is the reserved peak where the device has one (CUDA, measured), else the allocated
peak × a fragmentation factor (CPU or estimated lines): allocated and reserved are never added.
With fewer than 3 distinct points the model falls back to a + b·tokens through the phase's baseline
(what was live before it). Predictions outside the measured range are flagged `extrapolated`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from planner.records import PHASES

EVAL_PHASES = {"eval"}


@dataclass(frozen=True)
class Point:
    micro_batch: int
    seq_len: int
    bytes: float
    baseline: float | None = None


@dataclass
class PhaseFit:
    phase: str
    kind: str  # fit3 (a,b,c least squares) | linear (through the baseline) | constant
    coef: tuple[float, float, float]
    points: list[Point]
    max_rel_error: float = 0.0  # on the points it was fit to

    def predict(self, micro_batch: int, seq_len: int) -> float:
        a, b, c = self.coef
        t = micro_batch * seq_len
        return a + b * t + c * t * seq_len

    def in_range(self, micro_batch: int, seq_len: int) -> bool:
        mbs = [p.micro_batch for p in self.points]
        seqs = [p.seq_len for p in self.points]
        return min(mbs) <= micro_batch <= max(mbs) and min(seqs) <= seq_len <= max(seqs)


def fit_phase(phase: str, points: list[Point]) -> PhaseFit:
    distinct = {(p.micro_batch, p.seq_len) for p in points}
    y = np.array([p.bytes for p in points], dtype=float)
    t = np.array([p.micro_batch * p.seq_len for p in points], dtype=float)
    s = np.array([p.seq_len for p in points], dtype=float)
    if len(distinct) >= 3:
        X = np.stack([np.ones_like(t), t, t * s], axis=1)
        coef, *_ = np.linalg.lstsq(X, y, rcond=None)
        if coef[2] < 0 or coef[1] < 0:  # memory never shrinks with more tokens: refit without that term
            X2 = X[:, :2] if coef[2] < 0 else X[:, [0, 2]]
            c2, *_ = np.linalg.lstsq(X2, y, rcond=None)
            coef = np.array([c2[0], c2[1], 0.0]) if coef[2] < 0 else np.array([c2[0], 0.0, c2[1]])
        kind = "fit3"
    elif len(distinct) == 2:
        (m1, s1), (m2, s2) = sorted(distinct)
        y1 = np.mean([p.bytes for p in points if (p.micro_batch, p.seq_len) == (m1, s1)])
        y2 = np.mean([p.bytes for p in points if (p.micro_batch, p.seq_len) == (m2, s2)])
        slope = max(0.0, (y2 - y1) / ((m2 * s2) - (m1 * s1))) if m2 * s2 != m1 * s1 else 0.0
        coef, kind = np.array([y1 - slope * m1 * s1, slope, 0.0]), "linear"
    else:
        p = points[0]
        base = p.baseline if p.baseline is not None else p.bytes
        slope = max(0.0, (p.bytes - base) / (p.micro_batch * p.seq_len))
        coef, kind = np.array([p.bytes - slope * p.micro_batch * p.seq_len, slope, 0.0]), "linear"
        if slope == 0:
            kind = "constant"
    fit = PhaseFit(phase, kind, tuple(float(c) for c in coef), points)
    errs = [abs(fit.predict(p.micro_batch, p.seq_len) - p.bytes) / p.bytes for p in points if p.bytes > 0]
    fit.max_rel_error = max(errs) if errs else 0.0
    return fit


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
        phase = max(per_phase, key=per_phase.get)
        how = "measured at this configuration" if exact else ("extrapolated" if extrapolated else "interpolated")
        return Need(per_phase[phase], phase, f"{self.basis}; {how}", extrapolated and not exact, per_phase)


def phase_bytes(df: pd.DataFrame, fragmentation: float) -> pd.Series:
    """Reserved where the device has it, else allocated × fragmentation factor."""
    alloc = df["peak_allocated_bytes"].astype(float) * fragmentation
    reserved = df["peak_reserved_bytes"].astype(float)
    return reserved.where(reserved.notna(), alloc)


def build_model(lines: pd.DataFrame, fragmentation: float) -> MemoryModel | None:
    """lines: ok lines of one configuration family. None when nothing usable is there."""
    ok = lines[lines["verdict"] == "ok"].copy()
    if ok.empty:
        return None
    ok["need_bytes"] = phase_bytes(ok, fragmentation)
    ok = ok[ok["need_bytes"].notna()]
    fits, exact = {}, {}
    for phase in PHASES:
        rows = ok[ok["phase"] == phase]
        if rows.empty:
            continue
        mb_col, seq_col = ("eval_micro_batch", "eval_seq_len") if phase in EVAL_PHASES else ("micro_batch", "seq_len")
        points = [Point(int(r[mb_col]), int(r[seq_col]), float(r["need_bytes"]),
                        None if pd.isna(r["baseline_allocated_bytes"]) else
                        float(r["baseline_allocated_bytes"]) * (1 if pd.notna(r["peak_reserved_bytes"]) else fragmentation))
                  for _, r in rows.iterrows()]
        fits[phase] = fit_phase(phase, points)
        for _, r in rows.iterrows():
            key = (int(r["micro_batch"]), int(r["seq_len"]), int(r["eval_micro_batch"]), int(r["eval_seq_len"]))
            exact.setdefault(key, {})[phase] = max(exact.get(key, {}).get(phase, 0.0), float(r["need_bytes"]))
    devices = sorted(set(ok["device"]))
    names = sorted(set(ok["device_name"].fillna("")))
    modes = sorted(set(ok["mode"]))
    if ok["peak_reserved_bytes"].notna().all():
        basis = f"reserved peak, {'/'.join(modes)} on {', '.join(names) or ', '.join(devices)}"
    else:
        where = "CPU kernels, fake tensors" if modes == ["estimated"] else ", ".join(devices)
        basis = f"allocated peak × {fragmentation:g} (no reserved counter), {'/'.join(modes)} on {where}"
    # Only complete configurations count as exact measurements.
    exact = {k: v for k, v in exact.items() if set(v) >= set(fits)}
    return MemoryModel(fits, basis, exact)


def max_micro_batch(model: MemoryModel, seq_len: int, eval_micro_batch: int | None, eval_seq_len: int,
                    budget_bytes: float, limit: int = 4096) -> tuple[int, bool]:
    """Largest micro-batch whose need fits the budget at seq_len (0 if none); and whether extrapolated."""
    best, extrap = 0, False
    for mb in range(1, limit + 1):
        need = model.need(mb, seq_len, eval_micro_batch or mb, eval_seq_len)
        if need.bytes > budget_bytes:
            break
        best, extrap = mb, need.extrapolated
    return best, extrap


def max_seq_len(model: MemoryModel, micro_batch: int, budget_bytes: float, limit: int = 1 << 20,
                multiple: int = 64) -> tuple[int, bool]:
    """Largest seq_len (a multiple of `multiple`) that fits at micro_batch, eval at the same shape."""
    lo, hi = 0, limit // multiple
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.need(micro_batch, mid * multiple, micro_batch, mid * multiple).bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    seq = lo * multiple
    return seq, bool(seq) and model.need(micro_batch, seq, micro_batch, seq).extrapolated
