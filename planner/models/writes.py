"""Time to write a checkpoint or the export on a rented machine.

Measured on a GPU of the same kind where the ledger has it (the pilot's save and export phases time the whole
write: state gathered to the host, serialised, written, moved into place). Otherwise the bytes the pilot wrote
(a measured run's file size, or an estimate's state size) ÷ a write bandwidth: the offer's `disk_write_mib_s`,
else the catalog's default, which is an assumption and says so. A CPU's write time is never used for a GPU
machine: its disk is not the one rented.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from planner.units import MiB, fmt_bytes, fmt_seconds

KINDS = {"save": ("save_s", "save_bytes"), "export": ("export_s", "export_bytes")}


@dataclass(frozen=True)
class WriteTime:
    seconds: float | None  # None: nothing to size it from (the sheet says so; the plan reserves nothing)
    basis: str


def write_time(facts: pd.DataFrame, kind: str, gpu_id: str, same_kind, bandwidth_mib_s: float,
               bandwidth_source: str) -> WriteTime:
    """One save or export on `gpu_id`. `same_kind(device_name)` says whether a CUDA device is that GPU kind."""
    seconds_col, bytes_col = KINDS[kind]
    measured = facts[(facts["mode"] == "measured") & facts["device"].astype(str).str.startswith("cuda")]
    if seconds_col in measured and len(measured):
        mine = measured[measured["device_name"].map(same_kind)]
        secs = pd.to_numeric(mine[seconds_col], errors="coerce").dropna()
        if len(secs):
            return WriteTime(float(secs.median()), f"{kind} {fmt_seconds(float(secs.median()))} measured on "
                                                   f"{mine['device_name'].iloc[0]} (median of {len(secs)} run(s))")
    sizes = pd.to_numeric(facts[bytes_col], errors="coerce").dropna() if bytes_col in facts else pd.Series([])
    if not len(sizes) or not math.isfinite(float(sizes.max())) or float(sizes.max()) <= 0:
        return WriteTime(None, f"{kind}: no {kind} line with its size: not reserved (probe every phase to size it)")
    size = float(sizes.max())
    seconds = size / (bandwidth_mib_s * MiB)
    return WriteTime(seconds, f"{kind} {fmt_bytes(size)} ÷ {bandwidth_mib_s:g} MiB/s ({bandwidth_source}) = "
                              f"{fmt_seconds(seconds)}")
