"""The Python API under the commands (#46 item 3): the README's lines make a real plan, without torch or probes/,
and say the same decision and write the same files as `rentplan plan`."""

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.conftest import ROOT
from tests.factories import campaign_yaml, standard_ledger

BLOCKED = """
import sys

import pytest
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "probes"):
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, _Block())
"""


def readme_api_lines() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"## Python API.*?```python\n(.*?)```", readme, re.S).group(1)


@pytest.mark.slow  # two processes that plan, 7.5 s; test_a_plan_in_python_holds_what_its_files_say stays everyday
def test_the_readmes_api_lines_make_the_plan_that_rentplan_plan_makes(tmp_path):
    (tmp_path / "campaign.yaml").write_text(campaign_yaml())
    standard_ledger(tmp_path / "rentplan.db")
    code = readme_api_lines()
    assert "api.plan(" in code and ".write(" in code
    r = subprocess.run([sys.executable, "-c", BLOCKED + code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    said = r.stdout.strip()
    assert said.startswith("Recommended and ordered: "), said
    cli_out = CliRunner().invoke(cli, ["plan", "--campaign", str(tmp_path / "campaign.yaml"), "--ledger",
                                       str(tmp_path / "rentplan.db"), "--out", str(tmp_path / "by-cli")],
                                 catch_exceptions=False)
    assert cli_out.exit_code == 0 and said in cli_out.stdout
    api_files = sorted(p.name for p in (tmp_path / "rentplan-out").iterdir())
    assert api_files == sorted(p.name for p in (tmp_path / "by-cli").iterdir())
    assert {"order.json", "order_sheet.md", "plans.csv", "selection.csv", "budget.md"} <= set(api_files)
    for name in ("selection.csv", "plans.csv"):
        assert (tmp_path / "rentplan-out" / name).read_text() == (tmp_path / "by-cli" / name).read_text(), name
    ours, theirs = (json.loads((tmp_path / d / "order.json").read_text()) for d in ("rentplan-out", "by-cli"))
    assert ours["offer"] == theirs["offer"] and ours["expect"] == theirs["expect"]


def test_a_plan_in_python_holds_what_its_files_say(tmp_path):
    from planner import api

    (tmp_path / "c.yaml").write_text(campaign_yaml())
    led = standard_ledger(tmp_path / "l.db")
    plan = api.plan(tmp_path / "c.yaml", ledger=led, days=[7, 3, 7])
    assert sorted(plan.plans["days"].unique()) == [3, 7]  # a window named twice is one window
    assert plan.decision == api.decision_text(plan.sheet)
    assert plan.order["offer"]["id"] == plan.sheet[plan.sheet["ordered"]].iloc[0]["offer"]
    assert not (tmp_path / "out").exists()  # nothing is written until write()
    written = plan.write(tmp_path / "out")
    assert (tmp_path / "out" / "order.json") in written


def test_the_api_refuses_what_it_cannot_read_by_name(tmp_path):
    """A fresh-clone user (#46's attack): api.plan(..., days=7) and headroom="0.2" ended in bare TypeErrors from deep
    inside, api.plan(None) in pathlib's, and probes.api.grid(micro_bach="1") quietly ran the default grid while
    grid(params={"layers": 1}) was refused. Each is now said by name (or read as meant), before anything runs."""
    from planner import api
    from planner.errors import InputError
    from probes import api as probe_api

    (tmp_path / "c.yaml").write_text(campaign_yaml())
    ledger = standard_ledger(tmp_path / "l.db")
    made = api.plan(tmp_path / "c.yaml", ledger, days=7, headroom="0.2")  # an int window, a number as text
    assert set(made.plans["days"]) == {7}
    for kw, says in ((dict(campaign=None), "campaign must be"), (dict(days=None), "days must be"),
                     (dict(headroom="much"), "headroom must be")):
        with pytest.raises(InputError, match=says):
            api.plan(**{"campaign": tmp_path / "c.yaml", "ledger": ledger, **kw})
    with pytest.raises(InputError, match="out must be"):
        made.write(None)
    with pytest.raises(InputError, match="'micro_bach' \\(did you mean 'micro_batch'\\?\\)"):
        probe_api.grid(workload="builtin:gpt", micro_bach="1")
    assert probe_api.grid(workload="builtin:gpt", params={"layers": 1}, device="cpu").params == {"layers": 1}
