"""Names that reach a launch file (sky.yaml, order.json, a shell line) are checked where they enter.

Two rules:
- a label (campaign name, variant id, workload reference, a path) is one printable line: no control, format
  (zero-width, bidirectional overrides), separator, private-use or unassigned characters, at most 256 characters;
- an id (offer id, GPU id, provider, region) is ASCII letters, digits, '.', '_', '-' (and ':' where a workload
  reference needs one). A look-alike (a Cyrillic 'а' in 'vаst-h100') or an invisible character is refused by
  its Unicode name, so two ids that print the same can never both stand in a catalog.

Each check returns the problem as text (None when the value is fine): callers add it to their Problems.
"""

from __future__ import annotations

import functools
import re
import unicodedata

MAX_LABEL = 256
ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Unicode general categories that never belong in a one-line name: Cc control (newline, tab, ESC), Cf format
# (zero-width space U+200B, RTL override U+202E, BOM), Zl/Zp line and paragraph separators, Co private use,
# Cs surrogates, Cn unassigned.
BAD_CATEGORIES = {"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"}


def char_name(ch: str) -> str:
    return f"U+{ord(ch):04X} {unicodedata.name(ch, 'unnamed character')}"


@functools.lru_cache(maxsize=4096)  # a catalog repeats its dates, sources and notes thousands of times
def label_problem(value: str) -> str | None:
    """Why `value` is not a printable single line, or None."""
    if value.isascii() and value.isprintable() and len(value) <= MAX_LABEL and value == value.strip():
        return None  # printable ASCII holds no control, format or separator character: the common case, at once
    if len(value) > MAX_LABEL:
        return f"is {len(value)} characters long; at most {MAX_LABEL}"
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in BAD_CATEGORIES:
            return f"has {char_name(ch)} at position {i + 1}: it must be one printable line"
    if value != value.strip():
        return "starts or ends with white space"
    return None


@functools.lru_cache(maxsize=4096)
def id_problem(value: str, extra: str = "") -> str | None:
    """Why `value` is not an id (ASCII letters, digits, '.', '_', '-' and `extra`), or None. The first character
    outside that alphabet is named, so a look-alike or an invisible character is refused by name."""
    allowed = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._{re.escape(extra)}-]{{0,127}}")
    if allowed.fullmatch(value):
        return None
    if not value:
        return "is empty"
    if len(value) > 128:
        return f"is {len(value)} characters long; at most 128"
    for i, ch in enumerate(value):
        ok = ch.isascii() and (ch.isalnum() or (i > 0 and (ch in "._-" or ch in extra)))
        if not ok:
            kind = ("a look-alike of an ASCII letter or an invisible character" if not ch.isascii()
                    else "not allowed here")
            return (f"has {char_name(ch)} at position {i + 1} ({kind}): ids are ASCII letters, digits, '.', '_' and "
                    f"'-'{' and ' + repr(extra) if extra else ''}, starting with a letter or digit")
    return "is not an id"
