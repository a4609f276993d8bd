"""Bad input gives one `Error:` naming every problem with its key path, exit 1, no traceback."""

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import cli
from planner.inputs.catalog import default_catalog_path
from tests.factories import campaign_yaml, standard_ledger


def run(*args):
    return CliRunner().invoke(cli, list(args))


def assert_error(result, *fragments):
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") or "Error: " in result.output
    assert "Traceback" not in result.output
    for f in fragments:
        assert f in result.output, (f, result.output)


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def catalog_doc():
    return yaml.safe_load(default_catalog_path().read_text())


def test_bundled_catalog_validates_with_the_listed_gpus():
    r = run("catalog", "validate")
    assert r.exit_code == 0, r.output
    doc = catalog_doc()
    ids = {g["id"] for g in doc["gpus"]}
    assert len(ids) >= 15
    for want in ["b200", "h200_sxm", "h100_sxm", "h100_pcie", "a100_80gb_sxm", "a100_40gb", "l40s", "l4", "a10g",
                 "rtx_4090", "rtx_a6000", "rtx_6000_ada", "v100_16gb", "t4", "mi300x"]:
        assert want in ids
    for o in doc["offers"]:
        assert o["as_of"] and o["source"] and "billing_minimum_hours" in o


def test_an_instance_name_is_the_instance_type_alone(tmp_path, monkeypatch):
    """User (#44): the order for RTX 3090 × 2 named its instance "2x-RTX_3090 ($0.33/2)": a price fragment the
    catalog's draft wrote into the name. Every bundled offer's instance is the provider's type name alone (prices,
    regions and remarks live in their own fields and the note), as the order shows it."""
    import json
    import re

    from tests.factories import campaign_yaml, standard_ledger

    bad = [(o["id"], o["instance"]) for o in catalog_doc()["offers"]
           if o.get("instance") is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", o["instance"])]
    assert not bad, bad
    monkeypatch.chdir(tmp_path)
    standard_ledger(tmp_path / "l.db")
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    r = run("plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "out", "--offer", "vast-rtx_3090-2x")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "order.json").read_text())["offer"]["instance"] == "2x-RTX_3090"
    assert "$0.33/2" not in (tmp_path / "out" / "order_sheet.md").read_text()


def test_catalog_lists_every_problem_at_once(tmp_path):
    doc = catalog_doc()
    doc["gpus"][0]["memroy_gib_usable"] = 1  # typo
    del doc["gpus"][1]["mem_bandwidth_tbps"]  # missing field
    doc["offers"][0]["price_per_instance_hour_usd"] = float("nan")
    doc["offers"][1]["price_per_instance_hour_usd"] = -1.0
    doc["offers"][2]["price_per_instance_hour_usd"] = 0
    doc["offers"][3]["gpu"] = "h100_sxn"
    path = write(tmp_path, "bad.yaml", yaml.safe_dump(doc))
    r = run("catalog", "validate", path)
    assert_error(r, "6 problems",
                 "gpus[0].memroy_gib_usable: unknown key (did you mean 'memory_gib_usable'?)",
                 "gpus[1].mem_bandwidth_tbps: missing",
                 "offers[0].price_per_instance_hour_usd: must be finite",
                 "offers[1].price_per_instance_hour_usd: must be > 0",
                 "offers[2].price_per_instance_hour_usd: must be > 0",
                 "offers[3].gpu: unknown GPU id 'h100_sxn' (did you mean 'h100_sxm'?)")


def test_duplicate_keys_are_refused_with_line(tmp_path):
    path = write(tmp_path, "dup.yaml", "gpus: []\ngpus: []\n")
    assert_error(run("catalog", "validate", path), "duplicate key 'gpus'", "line 2")


def test_unsafe_tag_refused(tmp_path):
    path = write(tmp_path, "evil.yaml", "gpus: !!python/object/new:os.system [echo pwned]\n")
    assert_error(run("catalog", "validate", path), "unsafe or unknown tag refused")


def test_yaml_bomb_and_oversize_refused(tmp_path):
    bomb = "a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n"
    assert_error(run("catalog", "validate", write(tmp_path, "bomb.yaml", bomb)), "aliases are not allowed")
    # A full SkyPilot catalog (20,000 offers) is about 8 MiB: catalogs may be 32 MiB, specs and grids 2 MiB.
    big = write(tmp_path, "big.yaml", "# " + "x" * (33 * 1024 * 1024))
    assert_error(run("catalog", "validate", big), "over the 32768 KiB limit for catalog files")
    spec = write(tmp_path, "spec.yaml", "# " + "x" * (3 * 1024 * 1024))
    assert_error(run("plan", "--campaign", spec), "over the 2048 KiB limit for campaign files")


def test_unknown_gpu_suggests_close_match():
    assert_error(run("catalog", "show", "A100-80"), "unknown GPU 'A100-80'. Did you mean", "'a100_80gb_sxm'")


@pytest.mark.parametrize("edit, fragments", [
    ({"lrr": 1}, ["lrr: unknown key"]),
    ({"effective_batch": -16}, ["effective_batch: must be > 0"]),
    ({"updates": float("nan")}, ["updates: must be finite"]),
    ({"variants": [{"id": "a", "lr": "abc"}]}, ["variants[0].lr: must be a number"]),
    ({"variants": [{"id": False, "lr": 1e-4}]}, ["variants[0].id: must be a string", "quote it"]),
    ({"variants": [{"id": "a", "lr": 1e-4}, {"id": "a", "lr": 2e-4}]}, ["duplicate variant id 'a'"]),
    ({"eval": {"every_updates": 50}}, ["eval.examples: missing", "eval.seq_len: missing"]),
])
def test_campaign_problems(tmp_path, edit, fragments):
    ledger = standard_ledger(tmp_path / "l.db")
    camp = write(tmp_path, "c.yaml", campaign_yaml(**edit))
    assert_error(run("plan", "--campaign", camp, "--ledger", ledger), *fragments)


def test_campaign_reads_1e_minus_4_as_a_number(tmp_path):
    from planner.inputs.campaign_spec import load_campaign_text

    text = campaign_yaml().replace("lr: 0.0001", "lr: 1e-4")
    assert "1e-4" in text
    assert load_campaign_text(text, "t").variants[0].lr == 1e-4


def test_a_number_field_reads_a_number_quoted_or_not_and_only_ascii_digits(tmp_path):
    """The rule the README states: a number field reads a number written plainly or quoted (updates: '1e1' is 10,
    lr: '1e-3' is 0.001, !!str 6 is 6); digits of other scripts are refused with the number written out."""
    from planner.inputs.campaign_spec import load_campaign_text

    text = campaign_yaml().replace("updates: 200", "updates: '1e1'").replace("lr: 0.0001", "lr: '1e-3'")
    got = load_campaign_text(text.replace("setup_hours: 1", "setup_hours: !!str 2"), "t")
    assert (got.updates, got.variants[0].lr, got.setup_hours) == (10, 1e-3, 2)
    camp = write(tmp_path, "c.yaml", campaign_yaml().replace("updates: 200", "updates: \"\uff16\"")
                 .replace("setup_hours: 1", "setup_hours: \u0668"))
    assert_error(run("plan", "--campaign", camp, "--ledger", standard_ledger(tmp_path / "l.db")),
                 "updates: '\uff16' is written with digits other than 0-9: write it as 6",
                 "setup_hours: '\u0668' is written with digits other than 0-9: write it as 8")


@pytest.mark.parametrize("key, reads", [("on", "true"), ("~", "null"), ("1", "the number 1"),
                                        ("yes", "true"), ("2026-01-02", "a date")])
def test_a_key_yaml_reads_as_something_else_is_named_as_written_with_its_line(tmp_path, key, reads):
    """`on:` is YAML 1.1's true, `~:` its null: the spec's key is named as the user wrote it, with its line."""
    camp = write(tmp_path, "c.yaml", campaign_yaml() + f"{key}: push\n")
    line = len(campaign_yaml().splitlines()) + 1
    assert_error(run("plan", "--campaign", camp, "--ledger", standard_ledger(tmp_path / "l.db")),
                 f"the key {key!r} reads as {reads} in YAML; keys here are names: quote it ('{key}':)",
                 f"line {line}")


@pytest.mark.parametrize("as_of, ok", [("NOTADATE", False), ("2026-13-01", False), ("yesterday", False),
                                       ("2026-01-21", True), ("2026-05", True), ("before 2025-01-01", True),
                                       ("unknown (a blog post of 2025)", True)])
def test_a_catalog_price_date_is_a_date_or_says_it_is_unknown(tmp_path, as_of, ok):
    doc = catalog_doc()
    doc["offers"][0]["as_of"] = as_of
    r = run("catalog", "validate", write(tmp_path, "cat.yaml", yaml.safe_dump(doc)))
    if ok:
        assert r.exit_code == 0, r.output
    else:
        assert_error(r, "offers[0].as_of", f"{as_of!r} is not a date: write YYYY-MM-DD, YYYY-MM, "
                                           "'before YYYY-MM-DD' or 'unknown (why)'")


def test_missing_ledger_and_unknown_workload_params(tmp_path):
    camp = write(tmp_path, "c.yaml", campaign_yaml())
    assert_error(run("plan", "--campaign", camp, "--ledger", str(tmp_path / "none.db")), "no ledger at")
    ledger = standard_ledger(tmp_path / "l.db")
    camp2 = write(tmp_path, "c2.yaml", campaign_yaml(params={"layers": 99}))
    assert_error(run("plan", "--campaign", camp2, "--ledger", ledger), "no ledger lines for workload", "rentplan probe")


def test_the_readme_documents_every_key_of_the_campaign_spec():
    """User (#44): the spec's `optimizer` key was nowhere in the README. Every key the schema accepts (the spec's,
    its eval's, stop_if's, quality_target's and a variant's) is named in the README's Campaign spec section."""
    import re
    from pathlib import Path

    from planner.inputs.campaign_spec import CampaignEntry, VariantEntry
    from planner.inputs.schema import EvalSpecEntry, QualityEntry, StopEntry

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("\n## Campaign spec\n")[1].split("\n## ")[0]
    missing = [f"{where}{key}" for where, model in (("", CampaignEntry), ("eval.", EvalSpecEntry),
                                                    ("stop_if.", StopEntry), ("quality_target.", QualityEntry),
                                                    ("variants[].", VariantEntry))
               for key in model.model_fields if not re.search(rf"(\b{key}:|`{key}`)", section)]
    assert not missing, missing


def test_an_optimizer_the_ledger_lacks_names_the_ones_it_has(tmp_path):
    """User (#44): the HF Trainer's callback recorded `adamw_fused` (the Trainer's default), the spec left
    `optimizer` out (adamw), and plan said only "no lines with optimizer=adamw": it names what the ledger holds and
    the spec line that matches it."""
    from tests.factories import config, pilot_lines, write_ledger

    lines = []
    for mb in (1, 2):
        lines += pilot_lines(config(optimizer="adamw_fused", micro_batch=mb, eval_micro_batch=mb), 100 * 2**20)
    ledger = write_ledger(tmp_path / "l.db", lines)
    camp = write(tmp_path, "c.yaml", campaign_yaml())
    assert_error(run("plan", "--campaign", camp, "--ledger", ledger), "no lines with optimizer=adamw",
                 "The ledger holds optimizer=adamw_fused lines", "write `optimizer: adamw_fused` in the spec")


def test_probe_option_errors():
    assert_error(run("probe", "--micro-batch", "3", "--effective-batch", "16", "--device", "cpu"),
                 "not divisible by micro-batch 3")
    assert_error(run("probe", "--precision", "fp8", "--device", "cpu"), "precision 'fp8'")
    assert_error(run("probe", "--micro-batch", "0", "--device", "cpu"), "--micro-batch: '0' is not valid")
    assert_error(run("probe", "--cap", "h100-sxm5", "--device", "cpu", "-w", "nope.py:f"), "not found")
    assert_error(run("probe", "--strategy", "fsdp", "--device", "cpu"), "needs --nproc N >= 2")
    assert_error(run("estimate", "--strategy", "ddp", "--nproc", "2"), "a DDP rank holds what one process holds")


def test_probe_grid_file_builds_the_product_and_refuses_unknown_keys(tmp_path):
    from planner.inputs.grid import build_grid, spec_from_options

    good = write(tmp_path, "g.yaml", "micro_batch: [1, 2]\nseq_len: 64,128\nprecision: [bf16]\n"
                                      "params: {layers: 1}\neffective_batch: 4\n")
    spec = spec_from_options({"grid_file": good, "device": "cpu"})
    configs = build_grid(spec)
    assert len(configs) == 4 and {c.grad_accum for c in configs} == {4, 2} and spec.params == {"layers": 1}
    bad = write(tmp_path, "b.yaml", "micro_batchh: [1]\n")
    assert_error(run("probe", "--grid", bad, "--device", "cpu"),
                 "micro_batchh: unknown key (did you mean 'micro_batch'?)")


def test_an_unquoted_date_that_is_none_is_named_with_its_line(tmp_path):
    """A helper's attack: `name: 2026-02-30` (or a catalog's as_of) gave 'holds a number too long to read'."""
    camp = write(tmp_path, "c.yaml", campaign_yaml().replace("name: test-campaign", "name: 2026-02-30"))
    assert_error(run("plan", "--campaign", camp, "--ledger", standard_ledger(tmp_path / "l.db")),
                 "line 1: 2026-02-30 reads as a date in YAML, and is none (day is out of range for month)")
