"""The YAML loader builds documents from libyaml's events (planner/inputs/yamlsafe._load): whatever it takes, it
reads exactly as PyYAML's SafeLoader does; what it refuses (aliases, duplicate keys, unsafe tags) it says as an
Error. Generated documents in every style PyYAML writes, and mutated ones."""

import datetime

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.errors import InputError
from planner.inputs.yamlsafe import load_yaml_text

SAME = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
# The oracle is PyYAML's SafeLoader on the parser the loader reads events from (libyaml where PyYAML has it): the
# pure-Python scanner refuses a tab inside a plain scalar ('n\tull') that libyaml, and the YAML spec, allow.
SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=False),
                    st.text(max_size=12), st.dates().map(lambda d: d), st.sampled_from(
                        ["yes", "No", "on", "~", "0x1f", "0o17", "1_000", "1e3", "1.5e-4", ".inf", "2026-12-04",
                         "12:30:00", "'q'", "- x", "#c", "a: b", "&a", "*a", "!tag", "٨", "２４"]))
docs = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.one_of(st.text(max_size=8), st.integers()),
                                                                     inner, max_size=4)), max_leaves=25)


@SAME
@given(doc=docs, flow=st.sampled_from([None, True, False]), style=st.sampled_from([None, "'", '"']))
def test_what_pyyaml_writes_reads_back_as_pyyaml_reads_it(doc, flow, style):
    text = yaml.safe_dump(doc, default_flow_style=flow, default_style=style, allow_unicode=True)
    assert load_yaml_text(text, "t.yaml", string_keys=False) == yaml.load(text, Loader=SAFE)


@SAME
@given(doc=docs, cuts=st.lists(st.tuples(st.integers(0, 400), st.characters()), min_size=1, max_size=3))
def test_a_mutated_document_is_read_as_pyyaml_reads_it_or_refused_with_an_error(doc, cuts):
    chars = list(yaml.safe_dump(doc, allow_unicode=True))
    for i, c in cuts:
        chars.insert(min(i, len(chars)), c)
    text = "".join(chars)
    try:
        got = load_yaml_text(text, "t.yaml", string_keys=False)
    except InputError:
        return
    assert got == yaml.load(text, Loader=SAFE)


@pytest.mark.parametrize("text, says", [
    ("a: &x 1\nb: *x\n", "anchors and aliases"),
    ("a: 1\na: 2\n", "duplicate key 'a'"),
    ("? [1]\n: 2\n", "a key must be a plain word"),
    ("a: !!python/object/apply:os.system [echo]\n", "unsafe or unknown tag"),
    ("a: !!python/name:os.system\n", "unsafe or unknown tag"),
    ("a: !custom {b: 1}\n", "unsafe or unknown tag"),
    ("a: 1\n---\nb: 2\n", "found another document"),
    ("[" * 200 + "]" * 200, "nested too deeply"),
])
def test_refusals_are_errors(text, says):
    with pytest.raises(InputError, match=says):
        load_yaml_text(text, "t.yaml")


def test_scalars_keep_yaml_1_1_types():
    got = load_yaml_text("a: 2026-12-04\nb: '1'\nc: !!str 3\nd: ~\ne: [1, 2.5, yes, 0x1f]\nf: !!binary aGk=\n", "t")
    assert got == {"a": datetime.date(2026, 12, 4), "b": "1", "c": "3", "d": None, "e": [1, 2.5, True, 31],
                   "f": b"hi"}


@pytest.mark.parametrize("text", ["\ud800null\n...\n", "a: \udcff\n", '{"a": "\ud800"}'])
def test_a_lone_surrogate_is_refused_as_not_text(text):
    # hypothesis found '\ud800null': the size check's encode raised UnicodeEncodeError, a traceback
    with pytest.raises(InputError, match="lone surrogate at character"):
        load_yaml_text(text, "t.yaml")
