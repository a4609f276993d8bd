"""Units: bytes and seconds inside, GiB/MiB and hours only when printing. GiB = 2**30, GB = 1e9."""

from __future__ import annotations

import math
import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3
GB = 10**9

_SIZE = re.compile(r"^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:e[-+]?[0-9]+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$",
                   re.IGNORECASE | re.ASCII)
MAX_SIZE = 2**60  # an exbibyte: far above any device; a larger size is a typo
_FACTORS = {
    "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1024**4,
    "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
}


def parse_size(text: str) -> int | None:
    """'300MiB', '1e1GiB' -> bytes; None when the text is not written as a size (so callers can try a GPU id
    instead); ValueError for a size no device has (negative, endless, past an exbibyte)."""
    m = _SIZE.match(str(text))
    if not m:
        return None
    size = float(m.group(1)) * _FACTORS[(m.group(2) or "B").lower()]
    if not 0 <= size <= MAX_SIZE:  # 1e999 reads as inf, which fails the bound like a negative size
        raise ValueError(f"must be a size from 0 to {MAX_SIZE >> 60} EiB")
    return int(size)


def fmt_bytes(n: float | int | None) -> str:
    """Human figure for a byte count: GiB above 1 GiB, else MiB, else KiB; '' when unknown."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    n = float(n)
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / KiB:.1f} KiB"


def fmt_seconds(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return ""
    if s < 1e-3:  # a collective's latency: never '0.0 ms'
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1000:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def fmt_hours(h: float | None) -> str:
    """Hours in a unit that shows them: below an hour, as fmt_seconds shows seconds and minutes."""
    if h is None or (isinstance(h, float) and math.isnan(h)):
        return ""
    return f"{h:.2f} h" if h >= 1 else fmt_seconds(h * 3600)


def fmt_usd(x: float | None) -> str:
    """Dollars; amounts under a dollar in cents, so that small costs do not all read $0.00."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if 0 < abs(x) < 1:
        return f"{x * 100:.2g}¢" if abs(x) < 0.01 else f"{x * 100:.1f}¢"
    return f"${x:,.2f}"
