"""Leakage-safe splits of a data file (CSV, JSONL, Parquet) with pandas: no group in two splits, and with
a time column, validation after training and test after validation, with a gap. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from planner.errors import InputError

SPLITS = ("train", "val", "test")


def read_table(path: str | Path) -> pd.DataFrame:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"data file {p} not found.")
    suffix = p.suffix.lower()
    try:
        if suffix == ".csv":
            return pd.read_csv(p)
        if suffix in (".jsonl", ".ndjson"):
            return pd.read_json(p, lines=True)
        if suffix == ".json":
            return pd.read_json(p)
        if suffix == ".parquet":
            return pd.read_parquet(p)
    except ImportError as e:
        raise InputError(f"reading {p} needs an extra library ({e}); for Parquet: pip install pyarrow.") from None
    except ValueError as e:
        raise InputError(f"{p} could not be read as {suffix[1:]}: {e}") from None
    raise InputError(f"{p}: unknown data format {suffix!r}; use .csv, .jsonl or .parquet.")


def write_table(df: pd.DataFrame, path: Path) -> None:
    if path.suffix == ".csv":
        df.to_csv(path, index=False)
    elif path.suffix in (".jsonl", ".ndjson"):
        df.to_json(path, orient="records", lines=True)
    else:
        df.to_parquet(path, index=False)


def parse_ratios(text: str) -> tuple[float, ...]:
    try:
        ratios = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"--ratios {text!r} must be numbers like 0.8,0.1,0.1.") from None
    if len(ratios) not in (2, 3) or any(r < 0 for r in ratios) or abs(sum(ratios) - 1) > 1e-6:
        raise InputError(f"--ratios {text!r} must be 2 or 3 non-negative fractions summing to 1.")
    return ratios


@dataclass
class SplitResult:
    parts: dict[str, pd.DataFrame]
    report: pd.DataFrame
    dropped: int
    notes: list[str]


def _require(df: pd.DataFrame, col: str | None, what: str) -> None:
    if col and col not in df.columns:
        raise InputError(f"{what} column {col!r} is not in the data; columns: {', '.join(map(str, df.columns))}.")


def split_frame(df: pd.DataFrame, by: str | None, ratios: tuple[float, ...], time: str | None = None,
                gap: float | str | None = None, seed: int = 0) -> SplitResult:
    _require(df, by, "--by")
    _require(df, time, "--time")
    if not by and not time:
        raise InputError("give --by GROUP (and/or --time COLUMN): a plain random split can leak related rows.")
    names = SPLITS[: len(ratios)]
    notes: list[str] = []
    if time:
        assign, dropped = _time_split(df, by, ratios, time, gap, names, notes)
    else:
        assign, dropped = _group_split(df, by, ratios, names, seed), 0
    parts = {n: df[assign == n] for n in names}
    empty = [n for n, r in zip(names, ratios) if r > 0 and parts[n].empty]
    if empty:
        raise InputError(_empty_split_message(empty, df, by, time, gap, dropped, notes))
    report = pd.DataFrame([{
        "split": n, "rows": len(parts[n]), "row_fraction": round(len(parts[n]) / max(1, len(df)), 4),
        "target_fraction": r, "groups": int(parts[n][by].nunique()) if by else None,
        "time_min": parts[n][time].min() if time and len(parts[n]) else None,
        "time_max": parts[n][time].max() if time and len(parts[n]) else None,
    } for n, r in zip(names, ratios)])
    return SplitResult(parts, report, dropped, notes)


def _empty_split_message(empty, df, by, time, gap, dropped, notes) -> str:
    """Why a split would be empty, and what to change: nothing is written."""
    why = "; ".join(notes) if notes else f"{len(df)} rows in {df[by].nunique() if by else len(df)} " \
                                          f"{'groups' if by else 'rows'} cannot fill every split"
    fixes = []
    if gap:
        fixes.append("a smaller --gap")
    if time and by:
        fixes.append(f"--by {by} without --time (whole groups, no time order) or --time without --by")
    fixes.append("other --ratios")
    if by:
        fixes.append("more groups in the data")
    return (f"{' and '.join(empty)} would be empty ({why}; {dropped} of {len(df)} rows dropped). Nothing was "
            f"written. Try {', or '.join(fixes)}.")


def _group_split(df, by, ratios, names, seed) -> pd.Series:
    """Whole groups, shuffled, filled in order until each split reaches its share of rows."""
    sizes = df.groupby(by, sort=False).size()
    order = np.random.default_rng(seed).permutation(len(sizes))
    targets = np.cumsum(ratios) * len(df)
    group_split, filled, k = {}, 0, 0
    for i in order:
        while k < len(names) - 1 and filled >= targets[k] - 1e-9:
            k += 1
        group_split[sizes.index[i]] = names[k]
        filled += sizes.iloc[i]
    return df[by].map(group_split)


def _time_split(df, by, ratios, time, gap, names, notes) -> tuple[pd.Series, int]:
    t = df[time]
    if not pd.api.types.is_numeric_dtype(t):
        t = pd.to_datetime(t, errors="raise")
    gap_v = _gap_value(gap, t)
    cuts = t.quantile(np.cumsum(ratios)[:-1]).tolist()
    assign = pd.Series(names[-1], index=df.index, dtype=object)
    dropped = pd.Series(False, index=df.index)
    lo = None
    for name, cut in zip(names, cuts + [None]):
        in_range = pd.Series(True, index=df.index)
        if lo is not None:
            in_range &= t > lo
        if cut is not None:
            in_range &= t <= cut
        assign[in_range] = name
        if cut is not None and gap_v:
            dropped |= (t > cut) & (t <= cut + gap_v)  # the gap: rows too close to the previous split
        lo = cut
    if by:
        # A group seen in an earlier split keeps only its earliest split; later rows of it are dropped.
        rank = {n: i for i, n in enumerate(names)}
        first = assign.map(rank).groupby(df[by]).transform("min")
        spill = assign.map(rank) > first
        if spill.any():
            notes.append(f"{int(df.loc[spill, by].nunique())} group(s) spanned a time cut: their later rows "
                         f"({int(spill.sum())}) were dropped so that no group is in two splits")
        dropped |= spill
    if gap_v:
        notes.append(f"gap {gap}: {int(dropped.sum())} rows dropped in total")
    return assign.where(~dropped, "dropped"), int(dropped.sum())


def _gap_value(gap, t: pd.Series):
    if gap in (None, "", 0, "0"):
        return None
    if pd.api.types.is_numeric_dtype(t):
        try:
            return float(gap)
        except ValueError:
            raise InputError(f"--gap {gap!r} must be a number in the units of the time column.") from None
    try:
        return pd.Timedelta(gap if not str(gap).replace(".", "").isdigit() else f"{gap}D")
    except ValueError:
        raise InputError(f"--gap {gap!r} must be a duration like 7D or 12h (a plain number means days).") from None


def check_splits(frames: dict[str, pd.DataFrame], by: str | None) -> dict:
    """Groups in more than one split, and exact duplicate rows across splits."""
    leaks = []
    if by:
        for df in frames.values():
            _require(df, by, "--by")
        owners: dict = {}
        for name, df in frames.items():
            for g in df[by].unique():
                owners.setdefault(g, []).append(name)
        leaks = [{"group": g, "splits": ", ".join(s)} for g, s in owners.items() if len(s) > 1]
    dups = []
    names = list(frames)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            cols = [c for c in frames[a].columns if c in frames[b].columns]
            both = frames[a][cols].merge(frames[b][cols].drop_duplicates(), how="inner", on=cols)
            if len(both):
                dups.append({"splits": f"{a} & {b}", "rows": int(len(both)),
                             "example": both.iloc[0].to_dict()})
    return {"group_leaks": leaks, "duplicates": dups}
