"""`rentplan verify order.json` on the rented machine: the stack the order needs is the stack it checks, the torch
build must match the order's device (a CPU build of torch never passes for a CUDA order), and `--skip-pilot`
imports nothing of the user's (written from the user's steps: plan, then verify the order it wrote)."""

import json
import re

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import read_lines
from tests.conftest import TINY, has_cuda
from tests.factories import campaign_yaml, standard_ledger
from tests.test_launch import user_project

pytest.importorskip("torch")

MARKER = '''
import pathlib
pathlib.Path("IMPORTED").write_text("the workload's top level ran")
'''


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The user's project, planned once for the module (each test gets its own copy: they edit the order)."""
    import os

    root = user_project(tmp_path_factory.mktemp("verify") / "p")
    wl = root / "private" / "wl.py"
    wl.write_text(MARKER + wl.read_text())
    here = os.getcwd()
    os.chdir(root)
    try:
        r = CliRunner().invoke(cli, ["plan", "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out", "o",
                                     "--offer", "vast-rtx_4090-1x"])
    finally:
        os.chdir(here)
    assert r.exit_code == 0, r.output
    return root


@pytest.fixture
def order(planned, tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "p"
    shutil.copytree(planned, root, symlinks=True)
    monkeypatch.chdir(root)
    return root / "o" / "order.json"


def test_a_cpu_torch_is_refused_for_a_cuda_order_and_skip_pilot_imports_nothing(order, tmp_path):
    import torch

    r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
    assert r.exit_code == 1 and "do not adopt" in r.output, r.output
    if torch.version.cuda is None:  # this machine's build: the order is for CUDA
        assert (f"[FAIL] torch build: {torch.__version__} is the CPU build; the order is for CUDA: "
                "pip install --force-reinstall torch==2.13.0") in r.output
    assert "[ok  ] workload: will import make (line 5 of private/wl.py) when the pilot runs; not imported" in r.output
    assert not (order.parent.parent / "IMPORTED").exists()  # the workload's top level never ran


def test_the_packages_the_order_lists_are_checked(order):
    doc = json.loads(order.read_text())
    assert doc["stack"] == {"torch_requirement": "torch==2.13.0", "torch_build": "cuda", "extras": ["probe"],
                            "packages": ["torch", "safetensors"]}
    doc["stack"]["packages"].append("no_such_module_here")
    order.write_text(json.dumps(doc))
    r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
    assert "[FAIL] packages: missing: no_such_module_here (pip install 'rentplan[probe]')" in r.output
    assert r.exit_code == 1


@pytest.mark.parametrize("workload, params, optimizer, extras", [
    ("builtin:gpt", {}, "adamw", ["probe"]),
    ("hf:llama", {"lora": "r=8"}, "adamw", ["probe", "hf"]),
    ("hf:llama", {"lora": "r=8", "quantize": "nf4"}, "adamw", ["probe", "hf", "quant"]),
    ("builtin:gpt", {}, "paged_adamw8bit", ["probe", "quant"]),
    ("trainer:my-llama", {}, "adamw", ["probe", "hf"]),
    ("lightning:my-module", {}, "adamw", ["probe", "callbacks"]),
])
def test_extras_follow_the_workload(workload, params, optimizer, extras):
    from planner.outputs.orders import workload_extras

    assert workload_extras(workload, params, optimizer) == extras


def test_a_pilot_that_holds_what_the_plan_said_is_adopted_workspaces_included(tmp_path):
    """Planned from CPU lines for an H100: the need leaves out the 66 MiB of BLAS workspaces (the context holds
    them), and the rented GPU's reserved peak includes them. A pilot that measures exactly the plan is adopted;
    one past the plan's need, workspaces and tolerance is not."""
    from probes.verify import memory_check

    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", standard_ledger(tmp_path / "l.db"),
                                 "--out", str(tmp_path / "out"), "--offer", "aws-h100_sxm-8x"])
    assert r.exit_code == 0, r.output
    plan = json.loads((tmp_path / "out" / "order.json").read_text())["plan"]
    assert plan["workspace_bytes"] == 66 * 2**20 and plan["need_bytes"] < 660 * 2**20  # the gap outgrows 10 %
    assert plan["context_bytes"] >= plan["workspace_bytes"]
    measured = plan["need_bytes"] + plan["workspace_bytes"]  # what a GPU reads when the plan is right
    ok = memory_check(measured, plan)
    assert ok["status"] == "pass", ok["detail"]
    assert "incl. 66 MiB of BLAS workspaces from its context" in ok["detail"]
    assert memory_check(measured * 1.11, plan)["status"] == "fail"


def test_cuda_order_on_a_cpu_machine_is_not_adopted(tmp_path):
    if has_cuda():
        pytest.skip("this machine has CUDA")
    ledger = standard_ledger(tmp_path / "l.db")
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml())
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(out),
                                 "--offer", "aws-h100_sxm-8x"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["verify", str(out / "order.json")])
    assert r.exit_code == 1
    assert "do not adopt" in r.output and "no CUDA device found" in r.output and "H100" in r.output


@pytest.mark.slow
def test_order_from_this_machines_cpu_pilot_is_adopted(tmp_path):
    runner = CliRunner()
    ledger = str(tmp_path / "l.db")
    args = ["probe", "--ledger", ledger, "--device", "cpu", "--micro-batch", "1,2", "--seq-len", "32",
            "--precision", "bf16"] + [x for k, v in TINY.items() for x in ("-p", f"{k}={v}")]
    r = runner.invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml(params=TINY, seq_len=32, eval={"every_updates": 50, "examples": 8, "seq_len": 32}))
    out = tmp_path / "out"
    r = runner.invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(out),
                            "--offer", "local"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    order = json.loads((out / "order.json").read_text())
    assert order["expect"]["device_kind"] == "cpu"
    checked = str(tmp_path / "verify.db")
    r = runner.invoke(cli, ["verify", str(out / "order.json"), "--ledger", checked], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "adopt: every check passed" in r.output
    assert "[ok  ] peak memory" in r.output and "[ok  ] pilot: all phases ok" in r.output
    # The pilot's need follows the plan's rule: its lines carry the allocator model's reserved peak, so that is
    # the need (not allocated × the flat factor, a rule the plan uses only for lines without one).
    lines = read_lines(checked)
    assert lines["simulated_reserved_bytes"].notna().all()
    said = re.search(r"pilot needs ([0-9.]+) GiB", r.output).group(1)
    assert said == f"{lines['simulated_reserved_bytes'].max() / 2**30:.3f}"
    # Verified again with the same ledger: the finished pilot is not rerun, and its lines still decide.
    again = runner.invoke(cli, ["verify", str(out / "order.json"), "--ledger", checked], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert f"pilot needs {said} GiB" in again.output and "[ok  ] pilot: all phases ok" in again.output
    assert len(read_lines(checked)) == len(lines)


def test_a_listed_package_is_looked_up_never_imported(order, monkeypatch):
    """order.json names a package as sky.yaml's run block would find it (PYTHONPATH=$PWD, a folder beside the
    order): verify reads installed distributions' metadata, so the folder's code never runs and it is not 'there'."""
    root = order.parent.parent
    (root / "evilpkg").mkdir()
    (root / "evilpkg" / "__init__.py").write_text("import pathlib\npathlib.Path('EVIL_RAN').write_text('x')\n")
    (root / "evilpkg" / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(root))
    doc = json.loads(order.read_text())
    doc["stack"]["packages"] += ["evilpkg.sub", "evilpkg"]
    order.write_text(json.dumps(doc))
    r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
    assert "[FAIL] packages: missing: evilpkg.sub, evilpkg" in r.output, r.output
    assert not (root / "EVIL_RAN").exists()
    doc["stack"]["packages"] = ["torch", "safetensors", "yaml"]  # an import name whose distribution is PyYAML
    order.write_text(json.dumps(doc))
    r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
    assert "[ok  ] packages: installed: torch " in r.output and "yaml 6." in r.output, r.output


EDITS = [
    (lambda d: d.update(packages=["evilpkg"]), "packages: unknown key"),
    (lambda d: d["stack"].update(pakages=["torch"]), "stack.pakages: unknown key (did you mean 'packages'?)"),
    (lambda d: d["settings"].update(lr=[[1e-3]]), "settings.lr: unknown key"),
    (lambda d: d["offer"].update(gpus=8), "offer.gpus: unknown key"),
]


def test_an_order_with_a_key_rentplan_never_writes_is_refused_by_its_path(order):
    """A hand-edited order.json (a misspelt key, a setting verify would silently ignore) is refused before anything
    runs, naming the key as the file spells it; the order as plan wrote it passes."""
    r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
    assert "unknown key" not in r.output, r.output
    written = order.read_text()
    for edit, where in EDITS:
        doc = json.loads(written)
        edit(doc)
        order.write_text(json.dumps(doc))
        r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
        assert r.exit_code == 1 and r.output.startswith("Error: ") and where in r.output, r.output


def test_an_order_with_a_key_twice_or_a_bent_provenance_is_refused(order):
    """A helper's attacks: `"torch_build": "cuda", "torch_build": "cpu"` made the build check vanish (JSON's last
    one wins); provenance items took any key and value; an offer's region took shell text."""
    written = order.read_text()
    twice = written.replace('"torch_build": "cuda"', '"torch_build": "cuda", "torch_build": "cpu"')
    assert twice != written
    for text, says in ((twice, "duplicate key 'torch_build'"),
                       (written.replace('"mode":', '"modee":'), "provenance[0].modee: unknown key"),
                       (written.replace('"region": null', '"region": "us-east-1; rm -rf ~"'), "offer.region")):
        order.write_text(text)
        r = CliRunner().invoke(cli, ["verify", str(order), "--skip-pilot"])
        assert r.exit_code == 1 and r.output.startswith("Error: ") and says in r.output, (says, r.output)
