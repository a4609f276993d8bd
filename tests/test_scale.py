"""Large catalogs (issue 28): the sheet keeps the cheapest offer per market (provider, instance, GPU, count, nodes,
region, spot) and `--all-offers` writes the rest; a catalog written as JSON reads through the json module with the YAML
loader's refusals; a '*' or '&' inside a value does not cost a full alias scan. Speed and memory are measured side
by side by benchmarks/plan_speed.py, not timed here."""

import copy
import json

import pandas as pd
import pytest
import yaml
from click.testing import CliRunner

from planner.cli import cli
from planner.errors import InputError
from planner.inputs.yamlsafe import load_yaml_text
from tests.factories import campaign_yaml, standard_ledger

REGIONS = ("us-east-1", "eu-west-1")


def grown_catalog(path, copies: int = 3, as_json: bool = False):
    """The bundled catalog with each offer repeated `copies` times per region at other prices (as a SkyPilot
    import lists one instance type in many zones)."""
    from pathlib import Path

    cat = yaml.safe_load((Path(__file__).resolve().parent.parent / "catalog.yaml").read_text())
    offers = []
    for o in cat["offers"]:
        for region in REGIONS:
            for k in range(copies):
                offers.append({**copy.deepcopy(o), "id": f"{o['id']}-{region}-{k}", "note": f"region {region}",
                               "price_per_instance_hour_usd":
                                   round(o["price_per_instance_hour_usd"] * (1 + k / 10), 4)})
    cat["offers"] = offers
    path.write_text(json.dumps(cat) if as_json else yaml.safe_dump(cat, sort_keys=False))
    markets = {(o["provider"], o.get("instance"), o["gpu"], o["gpus_per_instance"], o.get("nodes", 1), o["note"],
                o["spot"], o.get("billing_minimum_hours", 0)) for o in offers}  # a capacity block is its own market
    return path, len(markets)


def plan(tmp_path, catalog, *extra):
    ledger = standard_ledger(tmp_path / "l.db")
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(tmp_path / "c.yaml"), "--ledger", ledger, "--catalog",
                                 str(catalog), "--out", str(tmp_path / "out"), *extra])
    assert r.exit_code == 0, r.output
    return pd.read_csv(tmp_path / "out" / "selection.csv")


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_the_sheet_keeps_the_cheapest_offer_per_market_and_all_offers_writes_the_rest(tmp_path):
    catalog, base = grown_catalog(tmp_path / "big.yaml")
    sheet = plan(tmp_path, catalog, "--all-offers")
    markets = base
    assert len(sheet) == markets  # one per market: a k=0 copy, the cheapest
    assert sheet["offer"].str.endswith("-0").all()
    assert sheet.groupby(["provider", "instance", "gpu", "gpus_per_instance", "nodes", "region", "spot",
                          "billing_minimum_hours"],
                         dropna=False).size().max() == 1
    every = pd.read_csv(tmp_path / "out" / "selection-all.csv")
    assert len(every) == 69 * len(REGIONS) * 3 and set(sheet["offer"]) <= set(every["offer"])
    # the recommendation is the one the whole catalog would give: the cheapest fitting campaign
    fits = every[every["verdict"] != "does not fit"]
    rec = sheet[sheet["recommended"]]["offer"].iloc[0]
    assert rec in set(fits[fits["campaign_cost_usd_high"] == fits["campaign_cost_usd_high"].min()]["offer"]) or \
        every.set_index("offer").loc[rec, "recommended"]
    md = (tmp_path / "out" / "order_sheet.md").read_text()
    assert f"{len(every) - markets} dearer offers of a market listed here" in md and "--all-offers" in md
    plan(tmp_path, catalog)  # a plan without the flag leaves no stale file of an earlier one
    assert not (tmp_path / "out" / "selection-all.csv").exists()


@pytest.mark.slow  # a grown catalog planned
def test_an_ordered_dearer_offer_stays_on_the_sheet(tmp_path):
    catalog, _ = grown_catalog(tmp_path / "big.yaml")
    sheet = plan(tmp_path, catalog, "--offer", "vast-rtx_4090-1x-eu-west-1-2")
    assert sheet.set_index("offer").loc["vast-rtx_4090-1x-eu-west-1-2", "ordered"]


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_a_json_catalog_plans_as_its_yaml_twin(tmp_path):
    y, _ = grown_catalog(tmp_path / "big.yaml", copies=1)
    j, _ = grown_catalog(tmp_path / "big.json", copies=1, as_json=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = plan(tmp_path / "a", y), plan(tmp_path / "b", j)
    pd.testing.assert_frame_equal(a.drop(columns=["notes"]), b.drop(columns=["notes"]))


@pytest.mark.parametrize("text, says", [
    ('{"offers": [], "offers": []}', "duplicate key 'offers'"),
    ('{"x": NaN}', "NaN is not a number here"),
    ('{"x": -Infinity}', "-Infinity is not a number here"),
    ('{"x": ' + "9" * 5000 + "}", "number too long"),
])
def test_json_text_is_refused_as_yaml_text_is(text, says):
    with pytest.raises(InputError, match=says):
        load_yaml_text(text, "c.json", 1 << 20)


def test_a_flow_mapping_that_is_not_json_still_reads_as_yaml():
    assert load_yaml_text("{a: 1, b: [x, y]}", "t") == {"a": 1, "b": ["x", "y"]}
    with pytest.raises(InputError, match="anchors and aliases"):
        load_yaml_text("{a: &x 1, b: *x}", "t")


def test_stars_and_ampersands_inside_values_are_not_aliases():
    assert load_yaml_text("a: H100* & more\nb: https://x?a=1&b=2", "t") == {
        "a": "H100* & more", "b": "https://x?a=1&b=2"}


@pytest.mark.slow  # a grown catalog planned
def test_catalog_import_writes_a_json_catalog_that_validates_and_plans(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vms.csv").write_text("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,"
                                      "Region\ngpu_1x_h100,H100,1,26,200,2.5,,us-east-1\n")
    r = CliRunner().invoke(cli, ["catalog", "import", "--skypilot", "vms.csv", "--provider", "lambda", "--as-of",
                                 "2026-12-01", "--out", "big.json"])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "big.json").read_text())
    assert data["offers"][-1]["provider"] == "lambda" and data["offers"][-1]["note"] == "region us-east-1"
    sheet = plan(tmp_path, tmp_path / "big.json")
    assert "lambda" in set(sheet["provider"]) and "us-east-1" in set(sheet["region"].dropna())


def test_one_dearer_offer_left_out_is_said_in_the_singular():
    """A helper's finding: '1 dearer offers … are left out'. The sentence agrees with its count on both sheets."""
    import re

    from planner.outputs.render import env

    for name in ("order_sheet.md.j2", "order_sheet.html.j2"):
        source = env().loader.get_source(env(), name)[0]
        block = re.search(r"\{% if dearer_offers %\}(.*?)\{% endif %\}", source, re.S).group(1)
        for n, said in ((1, "1 dearer offer of a market listed here (same provider"), (2, "2 dearer offers of a")):
            text = env().from_string(block).render(dearer_offers=n)
            assert said in text and ("is left out" if n == 1 else "are left out") in text
