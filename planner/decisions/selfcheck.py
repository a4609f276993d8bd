"""Estimates that check themselves. Where the ledger holds a measured run and an estimate of the same
configuration on the same device (the estimate with that device's own kernels: `estimate --target cpu` beside a
CPU `probe`; the pilot makes both cheap), the two are compared phase by phase on the allocated peak, which both
count exactly on a CPU (the live-tensor tracker). An estimate short of its measurement by more than 3 % misses
something the estimator does not model (an op whose fake kernel allocates less than the real one): every need the
campaign's estimates give is widened by the worst measured ÷ estimated ratio, and the sheet says so. An estimate
above its measurement is never used to narrow a need.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from planner.units import fmt_bytes

TOLERANCE = 0.03
PAIR = ["workload", "params_json", "precision", "optimizer", "checkpointing", "micro_batch", "seq_len",
        "eval_micro_batch", "eval_seq_len", "grad_accum", "strategy", "world_size", "rank", "device"]


@dataclass(frozen=True)
class Check:
    ratio: float  # measured ÷ estimated allocated peak: the worst phase of the worst pair
    note: str

    @property
    def widens(self) -> bool:
        return self.ratio > 1 + TOLERANCE


def estimate_check(lines: pd.DataFrame, precision: str) -> Check | None:
    """The comparison of this family's measured CPU runs with its CPU-kernel estimates at the same shape (None when
    the ledger has no such pair)."""
    ok = lines[(lines["verdict"] == "ok") & (lines["precision"] == precision)
               & lines["device"].astype(str).str.startswith("cpu") & (lines["cap"].fillna("") == "")]
    if ok.empty:
        return None
    target = ok["target"].fillna("") if "target" in ok else pd.Series("", index=ok.index)
    measured = ok[ok["mode"] == "measured"]
    estimated = ok[(ok["mode"] == "estimated") & target.isin(["", "cpu"])]
    if measured.empty or estimated.empty:
        return None
    worst = None
    for key, m in measured.groupby(PAIR, dropna=False):
        e = estimated
        for col, value in zip(PAIR, key):
            e = e[e[col] == value] if pd.notna(value) else e[e[col].isna()]
        if e.empty:
            continue
        m_peak = m.groupby("phase")["peak_allocated_bytes"].max()
        e_peak = e.groupby("phase")["peak_allocated_bytes"].max()
        common = m_peak.index.intersection(e_peak.index)
        ratios = (m_peak[common].astype(float) / e_peak[common].astype(float)).dropna()
        if ratios.empty:
            continue
        phase = ratios.idxmax()
        cand = (float(ratios[phase]), phase, m_peak[phase], e_peak[phase], key, m["device_name"].iloc[0])
        worst = cand if worst is None or cand[0] > worst[0] else worst
    if worst is None:
        return None
    ratio, phase, m_bytes, e_bytes, key, device_name = worst
    where = (f"estimate checked against a measurement of the same configuration on {device_name} (micro-batch "
             f"{int(key[5])} × seq {int(key[6])}, {phase}): measured {fmt_bytes(m_bytes)} allocated, estimated "
             f"{fmt_bytes(e_bytes)}")
    if ratio > 1 + TOLERANCE:
        return Check(ratio, f"{where}, short by {ratio - 1:.1%}: the need is widened × {ratio:.3f}")
    if ratio < 1 - TOLERANCE:
        return Check(ratio, f"{where}, above it by {1 - ratio:.1%}: the need is kept (never narrowed)")
    return Check(ratio, f"{where}: within {abs(ratio - 1):.1%}")
