"""A fresh-clone attack of round 3's fixes (#28), each written from the user's steps."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.inputs.grid import parse_params, resolve_cap
from planner.errors import InputError

ROOT = Path(__file__).resolve().parent.parent


def rentplan(*args, cwd):
    return subprocess.run([sys.executable, "-m", "planner.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("command", [["inspect"], ["probe", "--micro-batch", "1", "--seq-len", "8", "--ledger", "l.db"]])
@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_a_workload_that_forks_at_import_gets_an_error_and_leaves_no_process(tmp_path, command):
    """User: forky.py forks at import (the child sleeps 120 s): `probe` exited 0 without a word, and the child,
    a forkserver and a resource tracker outlived it."""
    marker = tmp_path / "child-ran"
    (tmp_path / "forky.py").write_text(
        "import os, time\n"
        "if os.fork() == 0:\n"
        f"    time.sleep(1.5); open({str(marker)!r}, 'w').close(); os._exit(0)\n"
        "def tiny():\n    pass\n")
    r = rentplan(*command, "-w", "forky.py:tiny", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Error:" in out and "os.fork" in out and "Traceback" not in out, out[-800:]
    time.sleep(2.5)
    assert not marker.exists(), "a process forked at import outlived the command"


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
    import yaml

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
