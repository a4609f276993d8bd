"""The order ships as a SkyPilot task: `plan --out` writes sky.yaml beside order.json, and SkyPilot's own parser
(`sky.Task.from_yaml`, run in the environment `make sky` builds: skypilot pins a click that transformers' hub
refuses, so it lives apart) accepts it with the order's accelerator, count, spot, cloud, nodes and launch."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import cli
from planner.outputs.launch import Launch, Layout
from planner.outputs.skypilot import disk_gb, sky_task
from tests.factories import campaign_yaml, standard_ledger

ROOT = Path(__file__).resolve().parents[1]
SKY_PYTHON = os.environ.get("RENTPLAN_SKY_PYTHON", str(ROOT / ".venv-sky" / "bin" / "python"))
SKY_READY = "RENTPLAN_SKY_PYTHON" in os.environ or (ROOT / ".venv-sky" / "installed").exists()
PARSE = """
import json, sys
import sky
t = sky.Task.from_yaml(sys.argv[1])
(r,) = list(t.resources)
print(json.dumps({"accelerators": r.accelerators, "use_spot": r.use_spot, "cloud": str(r.cloud) if r.cloud else None,
                  "disk_size": r.disk_size, "num_nodes": t.num_nodes, "run": t.run, "setup": t.setup}))
"""


def planned(tmp_path, offer, catalog=None):
    os.chdir(tmp_path)  # the launch folder: sky launch runs where plan ran
    ledger = standard_ledger(tmp_path / "l.db")
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml())
    out = tmp_path / offer
    args = ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(out), "--offer", offer]
    r = CliRunner().invoke(cli, args + (["--catalog", str(catalog)] if catalog else []))
    assert r.exit_code == 0, r.output
    return json.loads((out / "order.json").read_text()), out / "sky.yaml"


def sky_parse(path):
    if not SKY_READY:
        pytest.skip(f"SkyPilot's parser is not installed: run `make sky` (it builds {SKY_PYTHON})")
    r = subprocess.run([SKY_PYTHON, "-c", PARSE, str(path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def multi_node_catalog(tmp_path):
    doc = yaml.safe_load((ROOT / "catalog.yaml").read_text())
    doc["offers"].append({"id": "aws-h100-2node", "gpu": "h100_sxm", "provider": "aws", "instance": "p5.48xlarge",
                          "gpus_per_instance": 8, "nodes": 2, "network": "EFA", "network_gbps": 3200,
                          "price_per_instance_hour_usd": 55.04, "spot": False, "as_of": "2026-11-01",
                          "source": "aws_vantage", "note": "region us-east-1"})
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("offer, want", [
    ("azure-h100_nvl-1x-spot", {"accelerators": {"H100-NVL": 1}, "use_spot": True, "cloud": "Azure", "num_nodes": 1}),
    ("aws-h200_sxm-8x", {"accelerators": {"H200": 8}, "use_spot": False, "cloud": "AWS", "num_nodes": 1}),
])
@pytest.mark.slow
def test_sky_accepts_the_order(tmp_path, offer, want, monkeypatch):
    monkeypatch.chdir(ROOT)
    order, path = planned(tmp_path, offer)
    task = sky_parse(path)
    assert {k: task[k] for k in want} == want
    assert f"rentplan verify {offer}/order.json" in task["run"]
    strategy = order["settings"]["strategy"]  # single | ddp | fsdp; the label (e.g. "ddp × 8") beside it
    assert order["settings"]["strategy_label"].startswith(strategy)
    if strategy == "single":
        assert "rentplan campaign run" in task["run"] and "torchrun" not in task["run"]
    else:
        assert "torchrun" in task["run"] and "$SKYPILOT_NODE_RANK" in task["run"]
        assert "order-campaign.yaml --ledger rentplan.db --out rentplan-runs --strategy " + strategy in task["run"]
    assert "pip install -q torch==2.13.0" in task["setup"]  # the pilot's torch, without +cpu


@pytest.mark.slow
def test_multi_node_offer_gives_num_nodes_region_and_torchrun(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    order, path = planned(tmp_path, "aws-h100-2node", multi_node_catalog(tmp_path))
    assert order["offer"]["nodes"] == 2 and order["offer"]["region"] == "us-east-1"
    task = sky_parse(path)
    assert task["num_nodes"] == 2 and task["accelerators"] == {"H100": 8}
    assert "--nnodes=\"$SKYPILOT_NUM_NODES\"" in task["run"] and "--node_rank=\"$SKYPILOT_NODE_RANK\"" in task["run"]
    assert yaml.safe_load(path.read_text())["resources"]["region"] == "us-east-1"


def test_the_order_sheet_names_the_order_path_sky_yaml_verifies(tmp_path, monkeypatch):
    """User (#44): the order sheet said `rentplan verify order.json` where sky.yaml runs `rentplan verify
    unet-out/order.json`: both name the path from the launch folder, as the machine reads it."""
    monkeypatch.chdir(tmp_path)
    standard_ledger(tmp_path / "l.db")
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "unet-out"])
    assert r.exit_code == 0, r.output
    run = yaml.safe_load((tmp_path / "unet-out" / "sky.yaml").read_text())["run"]
    assert "rentplan verify unet-out/order.json" in run
    for sheet in ("order_sheet.md", "order_sheet.html"):
        text = (tmp_path / "unet-out" / sheet).read_text()
        assert "rentplan verify unet-out/order.json" in text and "verify order.json" not in text, sheet


def test_sky_yaml_says_what_its_disk_counts(tmp_path, monkeypatch):
    """User (#44): sky.yaml's disk_size stated no basis. A comment beside the task says what it counts: the
    floor for the environment and data, then per run the kept checkpoints and the export, with their sizes."""
    monkeypatch.chdir(tmp_path)
    standard_ledger(tmp_path / "l.db")
    (tmp_path / "c.yaml").write_text(campaign_yaml())  # two variants: two runs, each keeps its own
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "out"])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "out" / "sky.yaml").read_text()
    disk = yaml.safe_load(text)["resources"]["disk_size"]
    basis = next(line for line in text.splitlines() if line.startswith("# disk_size"))
    assert f"# disk_size {disk} GB = 100 GB floor (environment, data)" in basis
    assert "2 run(s) × (4 checkpoints (3 kept and the one being written) × 11.4 MiB + export 3.8 MiB)" in basis, basis


def test_disk_holds_kept_checkpoints_and_the_export(tmp_path):
    gib = 1024**3
    assert disk_gb(None, None) == 100
    # three kept, and a fourth written whole before the oldest goes (a helper's attack: the save at update 40 of
    # 25 MB checkpoints filled an 80 MB disk sized for three)
    assert disk_gb(40 * gib, 14 * gib) == 100 + 4 * 40 + 14
    assert disk_gb(40 * gib, 14 * gib, runs=4) == 100 + 4 * (4 * 40 + 14)  # every variant keeps its own
    order = {"campaign": "x", "offer": {"id": "o", "provider": "market_range_longtail", "gpus_per_instance": 1,
                                       "nodes": 1, "spot": False},
             "expect": {"gpu_id": "rtx_4090"}, "settings": {"strategy": "single", "workload": "builtin:gpt"},
             "stack": {"torch_requirement": "torch==2.13.0", "extras": ["probe", "hf"]}}
    launch = Launch(order, "", "out/order.json", "out/order-campaign.yaml", Layout(tmp_path))
    task = sky_task(order, launch, 10 * gib, None)
    assert task["resources"]["disk_size"] == 140
    assert "cloud" not in task["resources"]  # a market range names no cloud: SkyPilot chooses
    assert task["setup"].splitlines()[-1] == "pip install -q 'rentplan[probe,hf]==0.1.0'"  # this release
    # Lines from the user's own loop: the stack is verified, and the run asks for their command instead of
    # starting a campaign rentplan cannot run.
    own = {**order, "settings": {"strategy": "ddp × 8", "workload": "trainer:my-llama", "micro_batch": 4,
                                 "grad_accum": 2}}
    run = sky_task(own, launch)["run"]
    assert "rentplan verify out/order.json --skip-pilot" in run and "campaign run" not in run and "exit 2" in run


def test_strategy_outside_torchrun_is_refused(tmp_path):
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["campaign", "run", str(camp), "--ledger", str(tmp_path / "l.db"), "--strategy", "ddp"])
    assert r.exit_code == 1 and "Error: --strategy ddp shares updates between processes" in r.output
    assert not (tmp_path / "l.db").exists()
