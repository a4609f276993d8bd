"""Property: hostile text through every input that reaches sky.yaml (campaign name, variant id, offer id, region,
own-loop workload name, spec path, --out, the ledger's torch version) is refused with `Error:` where it enters, or
reaches sky.yaml as data: the file parses, holds only the task's keys, and every setup and run line splits into the
argv rentplan meant, with the hostile text as one word where it belongs."""

import json
import os
import shlex
import sqlite3
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cli import cli
from tests.factories import campaign_yaml, config, pilot_lines, write_ledger

ROOT = Path(__file__).resolve().parents[1]
PIECES = ["\n", "\r", "'", '"', "$(", ")", "`", "${IFS}", ";", "&&", "|", "#", ": ", "- ", "{", "}", "[", "]", "*",
          "&", "!", "%", "@", "\\", " ", "\t", "\u202e", "\u200b", "\u2028", "\x1b[2J", "\x00", "а", "ǀ", "~", "--",
          "envs:", "run:", "touch PWNED", "..", "/"]
hostile = st.lists(st.one_of(st.sampled_from(PIECES), st.text(min_size=1, max_size=3)), min_size=1, max_size=6) \
    .map("".join).filter(lambda s: s.strip() and "\x00" not in s)
INPUTS = ["name", "variant", "offer", "region", "trainer", "spec", "out", "torch"]
TASK_KEYS = {"name", "resources", "num_nodes", "workdir", "file_mounts", "setup", "run"}


def project(root: Path, where: str, text: str) -> tuple[list[str], str]:
    """A launch folder with the hostile text in one input; returns plan's arguments and the --out folder."""
    root.mkdir(parents=True, exist_ok=True)
    workload = f"trainer:{text}" if where == "trainer" else "builtin:gpt"
    cfgs = [config(workload=workload, micro_batch=mb, seq_len=256, eval_seq_len=256, eval_micro_batch=mb)
            for mb in (1, 2, 4)]
    lines = [x for cfg in cfgs for x in pilot_lines(cfg, 100 * 2**20 + cfg.micro_batch * 12_800_000)]
    write_ledger(root / "l.db", lines)
    if where == "torch":
        with sqlite3.connect(root / "l.db") as db:
            db.execute("UPDATE lines SET torch_version = ?", (text,))
    spec = yaml.safe_load(campaign_yaml(workload=workload))
    if where == "name":
        spec["name"] = text
    if where == "variant":
        spec["variants"][0]["id"] = text
    spec_name = text.replace("/", "_") + ".yaml" if where == "spec" else "c.yaml"
    (root / spec_name).write_text(yaml.safe_dump(spec, allow_unicode=True))
    offer = "vast-rtx_4090-1x"
    catalog = yaml.safe_load((ROOT / "catalog.yaml").read_text())
    if where in ("offer", "region"):
        offer = text if where == "offer" else "aws-hostile"
        catalog["offers"].append({"id": offer, "gpu": "rtx_4090", "provider": "aws", "gpus_per_instance": 1,
                                  "price_per_instance_hour_usd": 0.01, "spot": False, "as_of": "2026-12-01",
                                  "source": "test", "note": f"region {text}" if where == "region" else None})
    (root / "cat.yaml").write_text(yaml.safe_dump(catalog, allow_unicode=True))
    out = text if where == "out" else "o"
    return ["plan", "--campaign", spec_name, "--ledger", "l.db", "--catalog", "cat.yaml", "--out", out,
            "--offer", offer], out


def intended_run(out: str, where: str, text: str) -> list[list[str]]:
    order = os.path.normpath(os.path.join(out, "order.json"))
    head = [["set", "-euo", "pipefail"], [".", "~/rentplan-venv/bin/activate"],
            ["export", "PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}"]]
    if where == "trainer":
        return head + [["rentplan", "verify", order, "--skip-pilot"]]  # then echo and exit, checked below
    return head + [["rentplan", "verify", order],
                   ["rentplan", "campaign", "run", os.path.normpath(os.path.join(out, "order-campaign.yaml")),
                    "--ledger", "rentplan.db", "--out", "rentplan-runs"]]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(where=st.sampled_from(INPUTS), text=hostile)
def test_hostile_text_is_refused_or_stays_data(tmp_path_factory, where, text):
    root = tmp_path_factory.mktemp("p")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        args, out = project(root, where, text)
        before = sorted(p.name for p in root.iterdir() if not p.name.startswith("l.db-"))
        r = CliRunner().invoke(cli, args)
    finally:
        os.chdir(cwd)
    assert "Traceback" not in r.output and not (root / "PWNED").exists()
    if r.exit_code != 0:
        assert r.exit_code == 1 and r.output.startswith("Error:"), r.output
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith("l.db-")) == before  # nothing written
        return
    sky = root / out / "sky.yaml"
    task = yaml.safe_load(sky.read_text())
    assert set(task) <= TASK_KEYS and set(task["resources"]) <= {"accelerators", "use_spot", "disk_size", "cloud",
                                                                  "region"}
    run = [shlex.split(x, comments=True) for x in task["run"].splitlines()]
    want = intended_run(out, where, text)
    assert run[:len(want)] == want
    if where == "trainer":
        assert len(run) == 6 and run[4][0] == "echo" and run[4][2] == ">&2" and f"trainer:{text}" in run[4][1]
        assert run[5] == ["exit", "2"]
    else:
        assert len(run) == len(want)
    setup = [shlex.split(x, comments=True) for x in task["setup"].splitlines()]
    assert setup[3][:3] == ["pip", "install", "-q"] and len(setup) == 5
    order = json.loads((root / out / "order.json").read_text())
    if where == "region":
        assert task["resources"]["region"] == text == order["offer"]["region"]
