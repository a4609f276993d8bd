"""Output: one place that turns a DataFrame into table / markdown / csv / json text.

Numbers stay numbers until here; unknown values print empty (tables) or null (JSON), never NaN.
"""

from __future__ import annotations

import json
import math

import pandas as pd
from tabulate import tabulate

from planner.decisions.shapes import input_kind_of
from planner.shapes import dimension_words
from planner.units import fmt_bytes, fmt_seconds

FORMATS = ("table", "markdown", "csv", "json")
# Formats for programs: every field in raw units, no words for people around the table. The one place that says
# which formats these are; commands ask for_machines(fmt) rather than naming formats.
MACHINE_FORMATS = ("csv", "json")


def for_machines(fmt: str) -> bool:
    return fmt in MACHINE_FORMATS


def _clean(value):
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):  # numpy scalars
        return _clean(value.item())
    return value


def records(df: pd.DataFrame) -> list[dict]:
    return [{k: _clean(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def render(df: pd.DataFrame, fmt: str = "table", floatfmt: str = ".4g") -> str:
    if fmt == "json":
        return json.dumps(records(df), indent=2)
    if fmt == "csv":
        return df.astype(object).where(pd.notna(df), None).to_csv(index=False).rstrip("\n")
    rows = [[("" if v is None else format(v, floatfmt) if isinstance(v, float) else v) for v in r.values()]
            for r in records(df)]
    tablefmt = "github" if fmt == "markdown" else "simple"
    return tabulate(rows, headers=list(df.columns), tablefmt=tablefmt, floatfmt=floatfmt, disable_numparse=True)


def shape_text(r) -> str:
    """What the line's batch was: as read by role where the loop's call was read ("image 8×3×32×32"), else the
    micro-batch × seq_len rentplan's probe was told."""
    read = getattr(r, "input_shape", None)
    return read if isinstance(read, str) and read else f"mb{r.micro_batch}×{r.seq_len}"


def lines_view(df: pd.DataFrame, fmt: str, workload: bool = False) -> pd.DataFrame:
    """Machine formats get every field in raw units; people get a readable subset (with the workload where the
    lines may be of several: the ledger's)."""
    if for_machines(fmt):
        return df.drop(columns=["seq"], errors="ignore")
    view = pd.DataFrame({
        "run": df["run_id"],
        **({"workload": df["workload"]} if workload else {}),
        "config": [f"{shape_text(r)} acc{r.grad_accum} {r.precision} {r.optimizer}"
                   f"{' ckpt' if r.checkpointing else ''}{' cap=' + r.cap if r.cap else ''}"
                   f"{' @' + r.target if getattr(r, 'target', None) else ''}"
                   f"{f' {r.strategy}×{r.world_size} r{r.rank}' if r.world_size > 1 else ''}" for r in df.itertuples()],
        "phase": df["phase"],
        "verdict": df["verdict"],
        "mode": df["mode"],
        "device": df["device"],
        "alloc peak": df["peak_allocated_bytes"].map(fmt_bytes),
        "reserved peak": [fmt_bytes(r) if pd.notna(r) else (f"{fmt_bytes(sim)} sim" if pd.notna(sim) else "")
                          for r, sim in zip(df["peak_reserved_bytes"],
                                            df.get("simulated_reserved_bytes", pd.Series(None, index=df.index)))],
        "device-level": df["device_used_bytes"].map(fmt_bytes),
        "time": df["seconds"].where(df["mode"] == "measured").map(fmt_seconds),  # estimates time nothing
        "per update": df["update_s"].map(fmt_seconds),
        "detail": df["detail"].fillna("").str.slice(0, 60),
    })
    return view


def selection_view(sheet: pd.DataFrame, fmt: str, limit: int | None = 15) -> pd.DataFrame:
    if for_machines(fmt):
        return sheet
    from planner.outputs.render import sheet_rows

    rows = pd.DataFrame(sheet_rows(sheet.head(limit) if limit else sheet))
    dims = dimension_words(input_kind_of(sheet))  # "max seq" only where the model has a sequence
    rows = (rows.rename(columns={"max_seq": dims["column"]}) if dims["shown"]
            else rows.drop(columns=["max_seq"], errors="ignore"))
    return rows.drop(columns=["as_of", "notes", "gpu", "provider", "strategy_why", "kernel_basis", "kernel_note"],
                     errors="ignore")  # the kernels column says both


def plans_view(plans: pd.DataFrame, fmt: str) -> pd.DataFrame:
    if for_machines(fmt):
        return plans
    from planner.outputs.render import plan_rows

    return pd.DataFrame(plan_rows(plans, limit_per_window=3))
