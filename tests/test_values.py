"""Hostile values in the files and options a user hands in (issue 28, round 3): each is refused with `Error:` naming
its key, never a traceback, and writes nothing. Catalog entries go through one schema (planner/inputs/schema.py,
pydantic): a type, a bound and a message per field."""

import copy
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import cli
from planner.errors import InputError
from planner.inputs.grid import parse_params, resolve_cap

ROOT = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((ROOT / "catalog.yaml").read_text())


def gpu(key, value):
    return lambda d: d["gpus"][0].__setitem__(key, value)


def offer(key, value):
    return lambda d: d["offers"][0].__setitem__(key, value)


@pytest.mark.parametrize("mutate, says", [
    (offer("gpu", ["a"]), "offers[0].gpu: must be a non-empty string, got ['a'] (list)"),
    (gpu("sources", 5), "gpus[0].sources: must be a list of names"),
    (gpu("unverified", 5), "gpus[0].unverified: must be a list of names"),
    (offer("unverified", 5), "offers[0].unverified: must be a list of names"),
    (lambda d: d.__setitem__("sources", [1, 2]), "sources: must be a mapping of source tags"),
    (gpu("compute_capability", "abc"), "gpus[0].compute_capability: must be a compute capability like '8.0'"),
    (gpu("name", {"x": 1}), "gpus[0].name: must be a non-empty string"),
    (gpu("software", 123), "gpus[0].software: must be one of 'cuda' or 'rocm'"),
    (offer("price_per_instance_hour_usd", 1e-300), "offers[0].price_per_instance_hour_usd: must be at least 0.0001"),
    (offer("gpus_per_instance", 10**400), "offers[0].gpus_per_instance: must be at most 64, got an integer of 401"),
    (lambda d: d.__setitem__("defaults", [1]), "defaults: must be a mapping"),
    (gpu("memroy_gib", 1), "gpus[0].memroy_gib: unknown key (did you mean 'memory_gib_usable'?)"),
    (offer("id", "vаst-h100"), "U+0430 CYRILLIC SMALL LETTER A"),
])
def test_catalog_values_are_refused_by_name(tmp_path, mutate, says):
    doc = copy.deepcopy(BASE)
    mutate(doc)
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    for args in (["catalog", "validate", str(path)], ["catalog", "list", "--catalog", str(path)]):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 1 and r.output.startswith("Error:") and "Traceback" not in r.output, r.output
        assert says in r.output, r.output


def test_a_number_of_5000_digits_is_refused_before_python_reads_it(tmp_path):
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump(BASE).replace("memory_gib_usable: 22.49", "memory_gib_usable: " + "9" * 5000, 1))
    r = CliRunner().invoke(cli, ["catalog", "validate", str(path)])
    assert r.exit_code == 1 and "holds a number too long to read" in r.output


@pytest.mark.parametrize("args, says", [
    (["probe", "--seq-len", "99999999999", "--micro-batch", "1"], "--seq-len: '99999999999' is not valid (must be"),
    (["probe", "--cap", "0", "--micro-batch", "1"], "--cap 0: a cap below 1 MiB holds no model"),
    (["batch", "--micro-batch", "2", "--grad-accum", "8", "--compare", "micro=abc"], "'micro=abc' must be a whole"),
])
def test_option_values_are_refused_and_write_nothing(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, args + (["--ledger", "l.db"] if args[0] == "probe" else []))
    assert r.exit_code == 1 and says in r.output and "Traceback" not in r.output, r.output
    assert list(tmp_path.iterdir()) == []


def test_a_spec_with_a_huge_integer_is_refused(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text("name: x\nworkload: builtin:gpt\neffective_batch: " + "9" * 500 + "\nupdates: 10\n"
                    "eval: {every_updates: 5, examples: 4, seq_len: 32}\nvariants:\n  - {id: a, lr: 0.1}\n")
    r = CliRunner().invoke(cli, ["campaign", "run", str(spec), "--ledger", str(tmp_path / "l.db")])
    assert r.exit_code == 1 and "effective_batch: must be at most" in r.output and "integer of 500 digits" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def archive(tmp_path) -> Path:
    import hashlib
    import json

    dest = tmp_path / "arch"
    dest.mkdir()
    (dest / "README.md").write_text("hi\n")
    files = {"README.md": {"sha256": hashlib.sha256(b"hi\n").hexdigest(), "bytes": 3}}
    (dest / "manifest.json").write_text(json.dumps({"format": "rentplan-archive/1", "run_id": "c-1", "files": files}))
    return dest


@pytest.mark.parametrize("make, says", [
    (lambda d: __import__("os").mkfifo(d / "pipe"), "pipe is a fifo: refused"),
    (lambda d: __import__("socket").socket(__import__("socket").AF_UNIX).bind(str(d / "sock")), "sock is a socket"),
    (lambda d: (d / "empty").mkdir(), "empty is an empty folder"),
])
def test_an_archive_holding_anything_but_its_files_is_not_intact(tmp_path, make, says):
    dest = archive(tmp_path)
    assert CliRunner().invoke(cli, ["archive", "verify", str(dest)]).exit_code == 0
    make(dest)
    r = CliRunner().invoke(cli, ["archive", "verify", str(dest)])
    assert r.exit_code == 1 and says in r.output, r.output


def test_a_manifest_with_duplicate_keys_is_refused(tmp_path):
    dest = archive(tmp_path)
    text = (dest / "manifest.json").read_text()
    (dest / "manifest.json").write_text(text[:-1] + ', "run_id": "c-2"}')
    r = CliRunner().invoke(cli, ["archive", "verify", str(dest)])
    assert r.exit_code == 1 and "duplicate key 'run_id'" in r.output


def test_a_campaign_on_a_foreign_sqlite_file_makes_no_run_folder(tmp_path, monkeypatch):
    import sqlite3

    monkeypatch.chdir(tmp_path)
    with sqlite3.connect(tmp_path / "foreign.db") as db:
        db.execute("CREATE TABLE t (x)")
    (tmp_path / "c.yaml").write_text(
        "name: x\nworkload: builtin:gpt\nparams: {layers: 1, d_model: 32, heads: 2, vocab: 64}\nseq_len: 16\n"
        "effective_batch: 4\nupdates: 2\neval: {every_updates: 1, examples: 4, seq_len: 16}\nprecision: fp32\n"
        "variants:\n  - {id: a, lr: 0.1}\n")
    r = CliRunner().invoke(cli, ["campaign", "run", "c.yaml", "--ledger", "foreign.db"])
    assert r.exit_code == 1 and "not a rentplan ledger" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "foreign.db"]


@pytest.mark.parametrize("mutate, says", [
    (gpu("compute_capability", "٨.٩"), "must be a compute capability like '8.0'"),
    (gpu("memory_gib_usable", "２４"),
     "gpus[0].memory_gib_usable: '２４' is written with digits other than 0-9: write it as 24"),
    (lambda d: d.__setitem__("schema", "rentplan-catalog/2"), "schema: must be 'rentplan-catalog/1'"),
])
def test_look_alike_digits_and_unknown_formats_are_refused(tmp_path, mutate, says):
    doc = copy.deepcopy(BASE)
    mutate(doc)
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    r = CliRunner().invoke(cli, ["catalog", "validate", str(path)])
    assert r.exit_code == 1 and says in r.output, r.output


def test_ascii_digits_in_options_and_a_window_named_twice_is_one(tmp_path, monkeypatch):
    from tests.factories import campaign_yaml, standard_ledger

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["probe", "--micro-batch", "１", "--ledger", "l.db"])
    assert r.exit_code == 1 and "must be written in ASCII digits" in r.output
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    led = standard_ledger(tmp_path / "p.db")
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", led, "--days", "3,3", "--format", "json"])
    import json

    assert r.exit_code == 0 and {p["days"] for p in json.loads(r.output)["plans"]} == {3}
    assert len(json.loads(r.output)["plans"]) == len({p["offer"] for p in json.loads(r.output)["plans"]})


# ---------------------------------------------------------------- numbers written with an exponent or 5,000 digits

def test_numbers_with_an_exponent_in_params_are_numbers():
    """User: `-p width=1e1` reached the workload as the string '1e1' (README: 1e1 counts as a number)."""
    params = parse_params(["width=1e1", "big=2e9", "lr=1e-4", "name=e1", "ratio=2.5E+2", "text='1e1'"])
    assert params == {"width": 10, "big": 2_000_000_000, "lr": 1e-4, "name": "e1", "ratio": 250.0, "text": "1e1"}
    assert type(params["width"]) is int and type(params["lr"]) is float
    with pytest.raises(InputError, match=r"-p width"):
        parse_params(["width=1e30"])  # no workload parameter needs it; torch would fail far from here
    assert parse_params({"width": "1e1"}) == {"width": 10}  # a grid file's params read the same way


def test_a_cap_with_an_exponent_is_a_size_and_a_negative_or_endless_one_is_refused_as_a_size():
    """User: `--cap 1e1GiB` gave "unknown GPU '1e1GiB'"; `--cap -5GiB` and `--cap 1e999GiB` the same."""
    assert resolve_cap("1e1GiB", None) == ("1e1GiB", 10 * 2**30)
    for bad in ("-5GiB", "1e999GiB", "1e30GiB"):
        with pytest.raises(InputError, match=r"--cap") as e:
            resolve_cap(bad, None)
        assert "unknown GPU" not in str(e.value)


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_a_5000_digit_integer_in_a_catalog_is_refused_naming_its_line_and_key(tmp_path, fmt):
    """User: `catalog validate huge_int.yaml` said 'holds a number too long to read' without the field."""
    import json

    data = yaml.safe_load((ROOT / "catalog.yaml").read_text())
    data["gpus"][0]["memory_gib_usable"] = "HUGE"
    text = yaml.safe_dump(data, sort_keys=False) if fmt == "yaml" else json.dumps(data, indent=1)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "HUGE" in ln)
    text = text.replace("'HUGE'", "HUGE").replace('"HUGE"', "HUGE").replace("HUGE", "9" * 5000)
    path = tmp_path / f"huge.{fmt}"
    path.write_text(text)
    r = CliRunner().invoke(cli, ["catalog", "validate", str(path)])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert f"line {line}" in r.output and "memory_gib_usable" in r.output and "5,000 digits" in r.output, r.output


def test_a_campaign_specs_params_read_numbers_as_the_flag_does():
    """`params: {layers: 2e0}` in a spec is 2, as `-p layers=2e0` is; a 30-digit one is refused by its key path."""
    from planner.errors import CampaignError
    from planner.inputs.campaign_spec import load_campaign_text
    from tests.factories import PARAMS, campaign_yaml

    text = campaign_yaml(params={**PARAMS, "layers": "SIZE"})
    assert load_campaign_text(text.replace("SIZE", "2e0"), "spec.yaml").params["layers"] == 2
    with pytest.raises(CampaignError, match=r"params\.layers"):
        load_campaign_text(text.replace("SIZE", "1e30"), "spec.yaml")
