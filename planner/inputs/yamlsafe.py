"""YAML loading that refuses what it should: unsafe tags, duplicate keys, aliases (YAML bombs), huge files.

Validation helpers collect every problem with its key path, so one `Error:` names them all at once.
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path
from typing import Any

import yaml

from planner.errors import InputError
from planner.inputs.names import id_problem, label_problem

MAX_YAML_BYTES = 2 * 1024 * 1024  # specs and grids are a few KiB
# A full SkyPilot catalog (20,000 offers) is about 8 MiB as rentplan YAML: four times that, and no more.
MAX_CATALOG_BYTES = 32 * 1024 * 1024
# libyaml's parser where PyYAML has it (7.7 MiB: 5 s instead of 26 s); the constructors below stay Python.
_Base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", re.ASCII)  # '２４' and '٨' are not numbers here


class _StrictLoader(_Base):
    """The SafeLoader's resolver and scalar constructors (no python/* tags); documents are built by _load."""


_STR, _MAP, _SEQ = (yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG, yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                    yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG)


MAX_DEPTH = 100  # no file here needs more than a few levels; deeper is said as an Error, not a RecursionError
_PLAIN_TAGS = (None, "!")


def _load(text: str, string_keys: bool = False) -> Any:
    """The document built straight from libyaml's events (its C parser), not through PyYAML's composer and
    constructor: 4 × faster on a 20,000-offer catalog (about 1.2 s instead of 5 s), with the same refusals:
    duplicate and non-scalar keys, anchors and aliases (YAML bombs), unsafe tags, deep nesting. Plain scalars are
    typed by the SafeLoader's own resolver and constructors (YAML 1.1: int, float, bool, null, timestamps), once
    per distinct spelling; quoted ones are strings; an explicit tag on a scalar goes to the SafeLoader's
    constructors, which build it or refuse it; an explicit tag on a mapping or list is refused. With string_keys (a
    rentplan file, whose keys are names), a key YAML reads as something else (`on:` is true, `~:` null) is refused
    as written, with its line."""
    loader = _StrictLoader("")
    typed: dict[tuple, Any] = {}  # (value, tag) -> built value (immutable: numbers, bools, None, dates, text)
    stack: list[list] = []  # [container, pending key or _NO_KEY, {key: line}]
    doc, done = None, False
    try:
        for ev in yaml.parse(text, Loader=_Base):
            kind = type(ev)
            if kind is yaml.ScalarEvent:
                value = _scalar(loader, ev, typed)
            elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
                if ev.anchor is not None:
                    _refuse_alias(ev)
                if ev.tag not in _PLAIN_TAGS and ev.tag not in (_MAP, _SEQ):
                    raise yaml.constructor.ConstructorError(
                        None, None, f"could not determine a constructor for the tag {ev.tag!r}", ev.start_mark)
                if stack and stack[-1][1] is _NO_KEY and isinstance(stack[-1][0], dict):
                    raise yaml.constructor.ConstructorError(None, None, "a key must be a plain word or number, "
                                                            "not a list or mapping", ev.start_mark)
                if len(stack) >= MAX_DEPTH:
                    raise RecursionError("nested too deeply")
                stack.append([{} if kind is yaml.MappingStartEvent else [], _NO_KEY, {}])
                continue
            elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
                value = stack.pop()[0]
            elif kind is yaml.AliasEvent:
                _refuse_alias(ev)
            elif kind is yaml.DocumentStartEvent and done:
                raise yaml.composer.ComposerError("expected a single document in the stream", None,
                                                  "but found another document", ev.start_mark)
            else:
                continue
            if not stack:
                doc, done = value, True
                continue
            top = stack[-1]
            if isinstance(top[0], list):
                top[0].append(value)
            elif top[1] is _NO_KEY:
                if string_keys and not isinstance(value, str):
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {ev.value!r} reads as {_reads_as(value)} in YAML; keys here are names: "
                        f"quote it ('{ev.value}':)", ev.start_mark)
                if value in top[0]:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {value!r} (first at line {top[2][value] + 1})", ev.start_mark)
                top[1], top[2][value] = value, ev.start_mark.line
            else:
                top[0][top[1]], top[1] = value, _NO_KEY
    finally:
        loader.dispose()
    return doc


_NO_KEY = object()


def _reads_as(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value).lower().replace("none", "null")
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    return f"a {type(value).__name__}"  # date, datetime


def _scalar(loader: _StrictLoader, ev: yaml.ScalarEvent, typed: dict) -> Any:
    if ev.anchor is not None:
        _refuse_alias(ev)
    if ev.tag in _PLAIN_TAGS:
        if ev.tag == "!" or not ev.implicit[0]:  # quoted or '!'-tagged: a string, as PyYAML's composer says
            return ev.value
        tag = None
    else:
        tag = ev.tag
    key = (ev.value, tag)
    if key not in typed:
        node = yaml.ScalarNode(tag or loader.resolve(yaml.ScalarNode, ev.value, (True, False)), ev.value,
                               ev.start_mark, ev.end_mark)
        typed[key] = node.value if node.tag == _STR else loader.construct_object(node, deep=True)
    return typed[key]


def _refuse_alias(ev) -> None:
    raise yaml.composer.ComposerError(None, None, "anchors and aliases are not allowed here "
                                      "(they allow YAML bombs); write the values out", ev.start_mark)


class _JsonRefused(ValueError):
    pass


def no_duplicate_keys(pairs: list) -> dict:
    """json's object_pairs_hook: a key given twice is refused (json's last-one-wins would let an edit hide a value)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _JsonRefused(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_constant(name: str):
    raise _JsonRefused(f"{name} is not a number here")


def _load_json(text: str, source: str) -> Any:
    """A document written as JSON (YAML 1.2 holds JSON): read by the json module, 50 × faster than PyYAML on a
    20,000-offer catalog, with the YAML loader's refusals (duplicate keys, NaN/Infinity, integers past 4,300 digits).
    Returns NotImplemented when the text is not JSON after all (a YAML flow mapping), so YAML reads it."""
    import json

    try:
        return json.loads(text, object_pairs_hook=no_duplicate_keys, parse_constant=_json_constant)
    except _JsonRefused as e:
        raise InputError(f"{source} is not valid YAML: {e}") from None
    except json.JSONDecodeError:
        return NotImplemented
    except ValueError:  # Python refuses to read an integer of more than 4,300 digits
        raise InputError(_too_long(text, source)) from None


_LONG_NUMBER = re.compile(r"""(?:["']?([\w.-]+)["']?\s*:\s*)?[-+]?(\d{4000,})""", re.ASCII)


def _too_long(text: str, source: str) -> str:
    """Where the number Python will not read is (line and key), found in the text: the parsers say neither."""
    m = _LONG_NUMBER.search(text)
    if m is None:
        return f"{source} holds a number too long to read; no value here needs more than a few digits."
    line = text.count("\n", 0, m.start(2)) + 1
    key = f", key {m.group(1)!r}" if m.group(1) else ""
    return (f"{source} line {line}{key} holds a number too long to read ({len(m.group(2)):,} digits); no value "
            "here needs more than a few digits.")


def load_yaml_text(text: str, source: str, max_bytes: int = MAX_YAML_BYTES, string_keys: bool = True) -> Any:
    """A rentplan file's document (string_keys: its keys are names, see _load); string_keys=False reads any YAML
    exactly as PyYAML's SafeLoader does."""
    try:
        size = len(text.encode())
    except UnicodeEncodeError as e:  # a lone surrogate: text no UTF-8 file can hold (a file is decoded strictly)
        raise InputError(f"{source} holds a character that is not text (a lone surrogate at character {e.start}); "
                         "save it as UTF-8.") from None
    if size > max_bytes:
        raise InputError(f"{source} is larger than {max_bytes // 1024} KiB; refusing to parse it.")
    if text.lstrip()[:1] == "{":
        data = _load_json(text, source)
        if data is not NotImplemented:
            return data
    try:
        return _load(text, string_keys)
    except RecursionError:
        raise InputError(f"{source} is nested too deeply to read; no file here needs more than a few levels.") \
            from None
    except yaml.YAMLError as e:
        raise InputError(f"{source} is not valid YAML: {_yaml_message(e)}") from None
    except ValueError as e:  # an integer of more than 4,300 digits, or a date that is none (2026-02-30)
        raise InputError(_bad_date(text, source, e) or _too_long(text, source)) from None


_DATE_LIKE = re.compile(r"(?<![\w.-])(\d{4}-\d{1,2}-\d{1,2})(?![\w.:-])", re.ASCII)


def _bad_date(text: str, source: str, e: ValueError) -> str | None:
    """YAML reads an unquoted 2026-02-30 as a date and Python refuses it: say where, not 'a number too long'."""
    import datetime as dt

    for m in _DATE_LIKE.finditer(text):
        y, mo, d = (int(x) for x in m.group(1).split("-"))
        try:
            dt.date(y, mo, d)
        except ValueError as why:
            line = text.count("\n", 0, m.start()) + 1
            return (f"{source} line {line}: {m.group(1)} reads as a date in YAML, and is none ({why}); write the "
                    f"date it means, or quote it ('{m.group(1)}') where it is text.")
    return None


def load_yaml_file(path: str | Path, what: str, max_bytes: int = MAX_YAML_BYTES) -> Any:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} file {p} not found. Check the path (it is read from the folder you run in)"
                         + ("; examples: planner/examples/*.yaml." if what == "campaign" else "."))
    size = p.stat().st_size
    if size > max_bytes:
        raise InputError(f"{p} is {size} bytes, over the {max_bytes // 1024} KiB limit for {what} files.")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8.") from None
    except OSError as e:
        raise InputError(f"cannot read {p}: {e.strerror}.") from None
    return load_yaml_text(text, str(p), max_bytes)


def _yaml_message(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    if "could not determine a constructor" in str(problem) or "python/" in str(problem):
        problem = f"unsafe or unknown tag refused: {problem}"
    return f"{problem}{where}"


def _ascii_digits(text: str) -> str | None:
    """'６' -> '6' (full-width, Arabic-Indic and other decimal digits): a number the user meant, refused because a
    launch file and every reader downstream need ASCII; None when the text is not such a number."""
    if text.isascii() or not text:
        return None
    import unicodedata

    out = "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in text)
    return out if out.isascii() and _FLOAT.fullmatch(out) else None


class Problems:
    """Collects every validation problem with its key path; raise once at the end."""

    @staticmethod
    def show(value: Any) -> str:
        """A value as a message shows it: repr, cut at 60 characters; an integer too long to print or to be a
        float is named by its digits (repr raises past 4,300 of them)."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**18:
            return f"an integer of {len(str(abs(value))) if value.bit_length() < 14000 else 'over 4,000'} digits"
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    def __init__(self, source: str):
        self.source = source
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}" if path else message)

    def unknown_keys(self, path: str, data: dict, allowed: set[str] | list[str]) -> None:
        for key in data:
            if key not in allowed:
                hint = difflib.get_close_matches(str(key), list(allowed), n=1)
                extra = f" (did you mean {hint[0]!r}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
                self.add(_join(path, key), f"unknown key{extra}")

    def mapping(self, path: str, value: Any, allowed: set[str] | list[str], what: str = "a mapping") -> dict | None:
        """The value when it is a mapping (its unknown keys named); None, with the problem added, when not."""
        if not isinstance(value, dict):
            self.add(path, f"must be {what}")
            return None
        self.unknown_keys(path, value, allowed)
        return value

    def require(self, path: str, data: dict, keys: list[str]) -> None:
        for key in keys:
            if key not in data or data[key] is None:
                self.add(_join(path, key), "missing")

    def number(self, path: str, value: Any, *, positive: bool = False, allow_zero: bool = False,
               integer: bool = False, maximum: float | None = None, minimum: float | None = None) -> float | None:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string; it plainly means a number
        show = self.show(value)
        if isinstance(value, str) and (ascii_form := _ascii_digits(value.strip())) is not None:
            self.add(path, f"{show} is written with digits other than 0-9: write it as {ascii_form}")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.add(path, f"must be a number, got {show} ({type(value).__name__})")
            return None
        if isinstance(value, int) and abs(value) > 10**18:  # past any bound here, and past float's range soon
            self.add(path, f"must be at most {maximum if maximum is not None else 1e18:,g}, got {show}")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            self.add(path, f"must be finite, got {show}")
            return None
        if integer and not float(value).is_integer():
            self.add(path, f"must be a whole number, got {show}")
            return None
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            self.add(path, f"must be {'>= 0' if allow_zero else '> 0'}, got {show}")
            return None
        if maximum is not None and value > maximum:
            self.add(path, f"must be at most {maximum:,g}, got {show}")
            return None
        if minimum is not None and value < minimum:
            self.add(path, f"must be at least {minimum:g}, got {show}")
            return None
        return value

    def text(self, path: str, value: Any) -> str | None:
        if isinstance(value, bool):
            self.add(path, f"must be a string, got {value!r}: YAML reads yes/no/on/off as true/false; quote it")
            return None
        if not isinstance(value, str) or not value.strip():
            self.add(path, f"must be a non-empty string, got {self.show(value)} ({type(value).__name__})")
            return None
        return value

    def label(self, path: str, value: Any) -> str | None:
        """A name that may reach a launch file: a non-empty string on one printable line (planner/inputs/names)."""
        if self.text(path, value) is None:
            return None
        why = label_problem(value)
        if why:
            self.add(path, f"{self.show(value)} {why}")
            return None
        return value

    def ident(self, path: str, value: Any, extra: str = "") -> str | None:
        """An id (offer, GPU, provider, region): ASCII letters, digits, '.', '_', '-'; look-alikes refused by name."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if self.text(path, value) is None:
            return None
        why = id_problem(value, extra)
        if why:
            self.add(path, f"{self.show(value)} {why}")
            return None
        return value

    def boolean(self, path: str, value: Any) -> bool | None:
        if not isinstance(value, bool):
            self.add(path, f"must be true or false, got {self.show(value)}")
            return None
        return value

    def raise_if_any(self, error_cls: type[InputError] = InputError) -> None:
        if self.items:
            n = len(self.items)
            lines = "\n".join(f"  - {p}" for p in self.items)
            raise error_cls(f"{self.source} has {n} problem{'s' if n > 1 else ''}:\n{lines}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
