"""The shell contract: commands, files written, planning without torch, verify, the README example."""

import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.conftest import ROOT, WORKLOADS
from tests.factories import campaign_yaml, standard_ledger

BLOCK_TORCH = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _Block())
from planner.cli import cli
sys.exit(cli.main(args=sys.argv[1:], standalone_mode=True))
"""


def test_every_command_has_help():
    """Every command, in every group (campaign run, catalog import, ...), documents itself and answers --help."""
    import click

    runner = CliRunner()
    seen = []

    def walk(group, path):
        for name, cmd in group.commands.items():
            assert cmd.help, " ".join(path + [name])
            if not isinstance(cmd, click.Group):  # sqlite-utils' way: each command shows one real use
                assert "Example: rentplan" in cmd.help or "Example (" in cmd.help, " ".join(path + [name])
            r = runner.invoke(cli, [*path, name, "--help"])
            assert r.exit_code == 0 and "Usage:" in r.output, (path, name, r.output)
            seen.append(" ".join(path + [name]))
            if isinstance(cmd, click.Group):
                walk(cmd, path + [name])

    walk(cli, [])
    assert {"campaign run", "campaign report", "catalog import", "ledger show", "archive"} <= set(seen)


@pytest.mark.slow
def test_plan_without_torch_in_a_subprocess(tmp_path):
    ledger = standard_ledger(tmp_path / "l.db")
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml())
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH, "plan", "--campaign", str(camp), "--ledger", ledger,
                        "--out", str(out), "--format", "csv"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "offer,gpu,provider" in r.stdout.splitlines()[0]
    for name in ["selection.csv", "plans.csv", "order_sheet.md", "order_sheet.html", "budget.md", "order.json"]:
        assert (out / name).is_file(), name
    for cmd in (["ledger", "show", "--ledger", ledger], ["catalog", "list"], ["batch", "--micro-batch", "2",
                                                                                "--grad-accum", "8"]):
        r = subprocess.run([sys.executable, "-c", BLOCK_TORCH, *cmd], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
        assert r.returncode == 0, (cmd, r.stderr)


def test_every_planner_module_imports_without_torch():
    """planner/ never imports torch at module level: every module of every folder imports with torch blocked."""
    code = BLOCK_TORCH.split("from planner.cli")[0] + """
import importlib, pkgutil, planner
names = [m.name for m in pkgutil.walk_packages(planner.__path__, "planner.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) >= 30  # the folders' modules were found, not just the top level


def test_plan_outputs_say_where_numbers_came_from(tmp_path):
    ledger = standard_ledger(tmp_path / "l.db")
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml(budget_usd=1.0))
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", ledger, "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    sheet = (out / "order_sheet.md").read_text()
    assert "Rent this" in sheet and "measured" in sheet and "Test CPU" in sheet and "2.13.0+cpu" in sheet
    assert "price as of" in sheet and "CUDA >=" in sheet and "PyTorch >=" in sheet
    assert "★" in sheet
    order = json.loads((out / "order.json").read_text())
    assert order["format"] == "rentplan-order/1" and order["expect"]["device_kind"] == "cuda"
    budget = (out / "budget.md").read_text()
    assert "Budget cap $1.00" in budget
    html = (out / "order_sheet.html").read_text()
    assert html.startswith("<!doctype html>") and "</html>" in html


def test_ledger_show_has_a_workload_column_and_filter(tmp_path):
    """User (#44): a ledger holding a script's lines, a workload file's and a Trainer callback's showed no workload
    column and no way to pick one: `ledger show` lists the workload and takes --workload (with the names it holds
    when none matches)."""
    from tests.factories import config, pilot_lines, write_ledger

    lines = [*pilot_lines(config(workload="script:unet-denoiser-b"), 2**20),
             *pilot_lines(config(workload="unet.py:denoiser"), 2**20)]
    ledger = write_ledger(tmp_path / "l.db", lines)
    r = CliRunner().invoke(cli, ["ledger", "show", "--ledger", ledger])
    assert r.exit_code == 0 and "workload" in r.output.splitlines()[0]
    assert "script:unet-denoiser-b" in r.output and "unet.py:denoiser" in r.output
    r = CliRunner().invoke(cli, ["ledger", "show", "--ledger", ledger, "--workload", "script:unet-denoiser-b"])
    assert r.exit_code == 0 and "script:unet-denoiser-b" in r.output and "unet.py:denoiser" not in r.output
    assert len(r.output.strip().splitlines()) == 2 + 7  # header, rule, the script's seven lines
    r = CliRunner().invoke(cli, ["ledger", "show", "--ledger", ledger, "--workload", "script:unet"])
    assert r.exit_code == 1 and "Error: no lines of workload script:unet" in r.output
    assert "script:unet-denoiser-b, unet.py:denoiser" in r.output


def test_ledger_show_and_export(tmp_path):
    ledger = standard_ledger(tmp_path / "l.db")
    runner = CliRunner()
    r = runner.invoke(cli, ["ledger", "show", "--ledger", ledger, "--format", "json"])
    rows = json.loads(r.output)
    assert len(rows) == 28 and rows[0]["peak_reserved_bytes"] is None  # null, not NaN
    dest = tmp_path / "lines.jsonl"
    r = runner.invoke(cli, ["ledger", "export", "--ledger", ledger, "--to", str(dest)])
    assert r.exit_code == 0
    assert len(dest.read_text().splitlines()) == 28
    csv_dest = tmp_path / "lines.csv"
    runner.invoke(cli, ["ledger", "export", "--ledger", ledger, "--to", str(csv_dest)])
    assert csv_dest.read_text().startswith("run_id,probe_id,config_key,phase,verdict")


def test_catalog_import_skypilot(tmp_path):
    csv_text = (
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,Region,GpuInfo,SpotPrice\n"
        "gpu_8x_h100_sxm5,H100,8.0,208.0,1800.0,31.92,us-east-1,\"{'Gpus': [{'Name': 'H100', 'Count': 8.0, "
        "'MemoryInfo': {'SizeInMiB': 81920}}], 'TotalGpuMemoryInMiB': 81920}\",\n"
        "2x-H200-32-65536,H200,2,32,64.0,5.18,Michigan,\"{'Gpus': [{'Name': 'H200', 'Count': 2, "
        "'MemoryInfo': {'SizeInMiB': 287542}}]}\",0.00\n"
        "1x_A100-80GB_SECURE,A100-80GB,1.0,8.0,117.0,1.39,IN,\"{'Gpus': [{'Name': 'A100 PCIe', "
        "'MemoryInfo': {'SizeInMiB': 80}}]}\",0.90\n"
        "cpu-only,,,8,32,0.4,us,,\n"
        "x,Z9000,1,1,1,1.0,us,,\n")
    src = tmp_path / "vms.csv"
    src.write_text(csv_text)
    out = tmp_path / "merged.yaml"
    r = CliRunner().invoke(cli, ["catalog", "import", "--skypilot", str(src), "--provider", "sky",
                                 "--as-of", "2026-12-01", "--out", str(out)])
    assert r.exit_code == 0, r.output
    from planner.inputs.catalog import load_catalog

    offers = {o.id: o for o in load_catalog(out).offers if o.provider == "sky"}
    h100 = next(o for o in offers.values() if o.gpu == "h100_sxm")
    assert h100.gpus_per_instance == 8 and h100.price_per_instance_hour_usd == 31.92
    assert abs(h100.price_per_gpu_hour_usd - 3.99) < 1e-9
    h200 = [o for o in offers.values() if o.gpu == "h200_sxm"]
    assert len(h200) == 1 and not h200[0].spot  # SpotPrice 0.00 means no spot price
    a100 = [o for o in offers.values() if o.gpu == "a100_80gb_pcie"]
    assert {o.spot for o in a100} == {False, True}
    assert "Z9000" in r.output


def test_the_build_declares_every_package_and_its_data(tmp_path):
    """User (#44): every install printed setuptools' warning that 'planner.examples' is absent from the packages
    configuration; the packages list had also left out planner.commands, so a wheel could not run `rentplan`. The
    build warns of nothing, and the wheel holds every module of planner/ and probes/ and the example specs."""
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr
    assert "absent from the `packages` configuration" not in r.stderr + r.stdout
    names = set(zipfile.ZipFile(next(tmp_path.glob("rentplan-*.whl"))).namelist())
    modules = {p.relative_to(ROOT).as_posix() for top in ("planner", "probes") for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)
    assert {f"planner/examples/{p.name}" for p in (ROOT / "planner" / "examples").glob("*.yaml")} <= names


def test_readme_example_workload_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"A complete workload file.*?```python\n(.*?)```", readme, re.S).group(1)
    path = tmp_path / "my_workload.py"
    path.write_text(code)
    pytest.importorskip("torch")
    from probes.workloads import load_workload

    w = load_workload(f"{path}:regression", {"width": 32})
    model = w.build_model()
    batch = w.make_batch("train", 0, 4, 16)
    assert w.compute_loss(model, batch).ndim == 0
    assert (w.make_batch("train", 0, 4, 16)["x"] == batch["x"]).all()


def test_bad_workload_references_are_errors_not_tracebacks():
    pytest.importorskip("torch")
    runner = CliRunner()
    for ref, fragment in [("builtin:nope", "unknown built-in workload"), ("nope.py:f", "not found"),
                          (f"{WORKLOADS}:missing", "has no function 'missing'"),
                          (f"{WORKLOADS}:not_a_workload", "missing name, build_model, make_batch, compute_loss"),
                          (f"{WORKLOADS}:raises", "raised ValueError: bad parameter combination"),
                          ("no_such_module_xyz:f", "cannot find module")]:
        r = runner.invoke(cli, ["probe", "-w", ref, "--device", "cpu"])
        assert r.exit_code == 1 and "Error: " in r.output and fragment in r.output, (ref, r.output)
        assert "Traceback" not in r.output


def test_wheel_ships_templates_and_catalog(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr[-200:]}")
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("rentplan-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "planner/catalog.yaml" in names
    assert {"planner/templates/order_sheet.md.j2", "planner/templates/order_sheet.html.j2",
            "planner/templates/budget.md.j2"} <= set(names)
    assert "planner/examples/lr-comparison.yaml" in names
