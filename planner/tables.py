"""Output: one place that turns a DataFrame into table / markdown / csv / json text.

Numbers stay numbers until here; unknown values print empty (tables) or null (JSON), never NaN.
"""

from __future__ import annotations

import json
import math

import pandas as pd
from tabulate import tabulate

FORMATS = ("table", "markdown", "csv", "json")


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
