"""Every field of every file a user hands in (campaign spec, probe grid, order.json, archive manifest), given a
hostile value: it is either taken or refused with an Error that names that field's key path, never a traceback
or another exception (issue 28). The documents start as the product writes them."""

import copy
import json

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import cli
from planner.errors import InputError
from planner.inputs.campaign_spec import parse_campaign
from planner.inputs.grid import load_grid_file
from planner.inputs.schema import ManifestEntry, validate
from planner.inputs.yamlsafe import Problems
from planner.outputs.orders import check_order
from tests.factories import campaign_yaml, standard_ledger

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))

HOSTILE = st.one_of(
    st.sampled_from([None, True, False, 0, -1, 10**400, -10**19, float("nan"), float("inf"), 1e-300, 1e300, "",
                     " ", "٨", "２４", "1e3", "abc", "a\nb", "x\u202eevil", "zero\u200bwidth", "с", "\x00", "x" * 5000,
                     "$(reboot)", "; rm -rf ~", [], {}, [1, 2], {"a": 1}, ["a", ["b"]]]),
    st.integers(-10**30, 10**30), st.floats(), st.text(max_size=30),
    st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3))


def paths_of(doc, prefix=()):
    """Every key path of a document (mappings and lists), leaves and branches alike."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out += paths_of(v, (*prefix, k))
    return out


def put(doc, path, value):
    doc = copy.deepcopy(doc)
    at = doc
    for k in path[:-1]:
        at = at[k]
    at[path[-1]] = value
    return doc


def spelled(path) -> str:
    """A key path as the errors spell it: variants[0].lr."""
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")


def assert_named(path, message: str):
    """The error names the field or a key above it (a mapping's own problem), never something unrelated."""
    names = [spelled(path[:i]) for i in range(len(path), 0, -1)]
    assert any(n and n in message for n in names) or message.startswith("a campaign must"), (path, message)


SPEC = yaml.safe_load(campaign_yaml(stop_if={"nonfinite": True, "loss_above": 20.0},
                                    quality_target={"metric": "val_loss", "max_worse": 0.05},
                                    budget_usd=100, micro_batch=4, save_every_updates=50))


@PROPS
@given(where=st.sampled_from(paths_of(SPEC)), value=HOSTILE)
def test_any_hostile_value_in_a_campaign_spec_is_taken_or_refused_by_its_key(where, value):
    try:
        c = parse_campaign(put(SPEC, where, value), "c.yaml")
    except InputError as e:
        assert_named(where, str(e))
        return
    for text in (c.name, c.workload, *(v.id for v in c.variants)):  # taken: names are one printable line
        assert text.isprintable() and text.strip()
    assert 0 < c.effective_batch <= 1 << 20 and all(0 < v.lr <= 1e6 for v in c.variants)


GRID = {"workload": "builtin:gpt", "params": {"layers": 1}, "micro_batch": "1,2", "seq_len": [8, 16],
        "precision": "fp32,bf16", "checkpointing": "off,on", "optimizer": "adamw", "grad_accum": 1,
        "eval_micro_batch": 1, "steady_updates": 3, "lr": 1e-4, "cap": "l4", "device": "cpu", "timeout_s": 60,
        "strategy": "single", "nproc": 1}


@PROPS
@given(where=st.sampled_from(paths_of(GRID)), value=HOSTILE)
def test_any_hostile_value_in_a_grid_file_is_taken_or_refused_by_its_key(tmp_path_factory, where, value):
    path = tmp_path_factory.mktemp("g") / "g.yaml"
    try:
        path.write_text(yaml.safe_dump(put(GRID, where, value)))
    except (yaml.YAMLError, UnicodeEncodeError):
        return  # not writable as YAML text: nothing a user could hand in
    try:
        load_grid_file(str(path))
    except InputError as e:
        assert_named(where, str(e))


@pytest.fixture(scope="module")
def order(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    (root / "c.yaml").write_text(campaign_yaml())
    led = standard_ledger(root / "l.db")
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(root / "c.yaml"), "--ledger", led, "--out",
                                 str(root / "o")])
    assert r.exit_code == 0, r.output
    return json.loads((root / "o" / "order.json").read_text())


CHECKED = ("format", "expect", "settings", "plan", "stack", "campaign", "offer")


def test_the_order_the_product_writes_passes_its_own_schema(order):
    check_order(order, "order.json")


@PROPS
@given(data=st.data(), value=HOSTILE)
def test_any_hostile_value_in_an_order_is_taken_or_refused_by_its_key(order, data, value):
    where = data.draw(st.sampled_from([p for p in paths_of(order) if p[0] in CHECKED]))
    try:
        check_order(put(order, where, value), "order.json")
    except InputError as e:
        assert_named(where, str(e))


MANIFEST = {"format": "rentplan-archive/1", "run_id": "c-0123456789",
            "files": {"README.md": {"sha256": "ab" * 32, "bytes": 10}, "metrics.csv": {"sha256": "cd" * 32,
                                                                                   "bytes": 0}}}


@PROPS
@given(where=st.sampled_from(paths_of(MANIFEST)), value=HOSTILE)
def test_any_hostile_value_in_a_manifest_is_taken_or_refused_by_its_key(where, value):
    p = Problems("manifest.json")
    if validate(ManifestEntry, put(MANIFEST, where, value), p, "") is None:
        assert p.items and any(spelled(where[:i]) in " ".join(p.items) for i in range(len(where), 0, -1)), \
            (where, p.items)
