"""The order launches on the rented machine: sky.yaml, tested the way it is used. SkyPilot's own parser and upload
rule carry the launch folder and the file mounts (tests/launch_sim.py), then setup and run execute against stubs
that load every file they are handed. The files the run needs are git-ignored here, as rentplan-out/ usually is."""

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from planner.cli import cli
from planner.outputs.skypilot import SOURCE_PARTS
from tests.factories import campaign_yaml, config, pilot_lines, write_ledger
from tests.launch_sim import ROOT, launch

WORKLOAD = '''"""A user's workload, in a folder .gitignore leaves out of the workdir upload."""
def make(width=64, data=None):
    raise RuntimeError("the launch test never calls the workload")
'''


def git_project(root: Path, ignored: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("\n".join(ignored) + "\n")
    return root


def user_project(root: Path) -> Path:
    """A project whose workload file and data are git-ignored, planned from lines of its own workload (the
    pilot's seven phases, as tests/factories.pilot_lines makes them)."""
    git_project(root, ["rentplan-out/", "rentplan.db", "private/", "data/"])
    (root / "private").mkdir()
    (root / "private" / "wl.py").write_text(WORKLOAD)
    (root / "data").mkdir()
    (root / "data" / "train.txt").write_text("some text\n")
    params = {"width": 64, "data": "data/train.txt"}
    lines = []
    for mb in (1, 2, 4):
        cfg = config(workload="private/wl.py:make", params_json=json.dumps(params, sort_keys=True), micro_batch=mb,
                     seq_len=256, eval_seq_len=256, eval_micro_batch=mb)
        lines += pilot_lines(cfg, 100 * 2**20 + mb * 256 * 50_000)
    write_ledger(root / "rentplan.db", lines)
    (root / "campaign.yaml").write_text(campaign_yaml(workload="private/wl.py:make", params=params))
    return root


def invoke_plan(root: Path, monkeypatch, *args):
    monkeypatch.chdir(root)
    r = CliRunner().invoke(cli, ["plan", *args])
    assert r.exit_code == 0, r.output
    return r


def assert_launches(root: Path, out: str, tmp_path: Path) -> dict:
    """Launch the plan's sky.yaml: setup and run succeed against the stubs, verify first, then the campaign."""
    result = launch(root / out / "sky.yaml", root, tmp_path / "sim")
    for section in ("setup", "run"):
        assert result[section].returncode == 0, result[section].stdout + result[section].stderr
    assert result["calls"][0] == ["rentplan", "verify", f"{out}/order.json"]
    run = result["calls"][1]
    assert run[run.index("campaign"):run.index("campaign") + 3] == ["campaign", "run", f"{out}/order-campaign.yaml"]
    return result


def test_the_order_reaches_the_machine_whatever_gitignore_says(tmp_path, monkeypatch):
    root = user_project(tmp_path / "project")
    invoke_plan(root, monkeypatch, "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out", "rentplan-out",
                "--offer", "vast-rtx_4090-1x")
    result = assert_launches(root, "rentplan-out", tmp_path)
    home = result["home"] / "sky_workdir"
    # the ignored files arrived, each where the spec and the order name it
    assert (home / "private" / "wl.py").read_text() == WORKLOAD
    assert (home / "data" / "train.txt").exists() and (home / "rentplan-out" / "order.json").exists()
    assert "stub campaign run: will import make (line 2 of" in result["run"].stdout
    assert result["calls"] == [["rentplan", "verify", "rentplan-out/order.json"],
                               ["rentplan", "campaign", "run", "rentplan-out/order-campaign.yaml", "--ledger",
                                "rentplan.db", "--out", "rentplan-runs"]]
    assert result["pip"][0] == "pip install -q torch==2.13.0" and result["pip"][1].endswith("rentplan[probe]")


@pytest.mark.slow
def test_a_spec_and_out_folder_outside_the_launch_folder_travel_too(tmp_path, monkeypatch):
    root = user_project(tmp_path / "project")
    elsewhere = tmp_path / "specs"
    elsewhere.mkdir()
    (elsewhere / "wl.py").write_text(WORKLOAD)
    text = (root / "campaign.yaml").read_text().replace("private/wl.py:make", "wl.py:make")
    (elsewhere / "c.yaml").write_text(text.replace("data/train.txt", str(root / "data" / "train.txt")))
    # the ledger's lines name the workload as the spec does (the family rule compares the reference)
    import sqlite3

    with sqlite3.connect(root / "rentplan.db") as db:
        db.execute("UPDATE lines SET workload = 'wl.py:make', params_json = ?",
                   (json.dumps({"data": str(root / "data" / "train.txt"), "width": 64}, sort_keys=True),))
    invoke_plan(root, monkeypatch, "--campaign", str(elsewhere / "c.yaml"), "--ledger", "rentplan.db", "--out",
                str(tmp_path / "orders"), "--offer", "vast-rtx_4090-1x")
    task = yaml.safe_load((tmp_path / "orders" / "sky.yaml").read_text())
    assert all(k.startswith("~/sky_workdir/.rentplan-launch/") for k in task["file_mounts"] if "rentplan-launch" in k)
    result = launch(tmp_path / "orders" / "sky.yaml", root, tmp_path / "sim")
    assert result["run"].returncode == 0, result["run"].stdout + result["run"].stderr
    assert result["calls"][0][:2] == ["rentplan", "verify"] and result["calls"][1][1:3] == ["campaign", "run"]


# Names that once put commands into sky.yaml (the five, and YAML syntax): each is refused where it enters,
# or reaches sky.yaml as data, one argv word, never run.
HOSTILE = ["evil\nenvs:\n  BASH_ENV: /tmp/x", "$(touch PWNED)", "a b'c\"d", "`touch PWNED`", "x: [y, {z: 1}]",
           "#comment", "-rf", "\u202eevil", "va\u200bst"]


@pytest.mark.slow
@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_campaign_names_and_variant_ids_are_refused_or_inert(tmp_path, monkeypatch, name):
    root = user_project(tmp_path / "p")
    spec = yaml.safe_load((root / "campaign.yaml").read_text())
    spec["name"], spec["variants"][0]["id"] = name, name
    (root / "campaign.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(root)
    r = CliRunner().invoke(cli, ["plan", "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out", "o",
                                 "--offer", "vast-rtx_4090-1x"])
    if r.exit_code != 0:
        assert r.exit_code == 1 and r.output.startswith("Error:") and "Traceback" not in r.output
        assert not (root / "o").exists()
        return
    assert_sky_yaml_is_data(root / "o" / "sky.yaml", "o")


def assert_sky_yaml_is_data(path: Path, out: str) -> None:
    """sky.yaml parses; its keys are the task's; each setup and run line splits into the intended argv."""
    task = yaml.safe_load(path.read_text())
    assert set(task) <= {"name", "resources", "num_nodes", "workdir", "file_mounts", "setup", "run"}
    assert set(task["resources"]) <= {"accelerators", "use_spot", "disk_size", "cloud", "region"}
    order_rel = os.path.normpath(f"{out}/order.json")
    spec_rel = os.path.normpath(f"{out}/order-campaign.yaml")
    assert [shlex.split(x, comments=True) for x in task["run"].splitlines()] == [
        ["set", "-euo", "pipefail"], [".", "~/rentplan-venv/bin/activate"],
        ["export", "PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}"], ["rentplan", "verify", order_rel],
        ["rentplan", "campaign", "run", spec_rel, "--ledger", "rentplan.db", "--out", "rentplan-runs"]]
    assert [shlex.split(x, comments=True) for x in task["setup"].splitlines()] == [
        ["set", "-euo", "pipefail"], ["python3", "-m", "venv", "~/rentplan-venv"],
        [".", "~/rentplan-venv/bin/activate"], ["pip", "install", "-q", "torch==2.13.0"],
        ["pip", "install", "-q", "-e", "$HOME/rentplan[probe]"]]
    assert task["file_mounts"] == {f"~/sky_workdir/{order_rel}": f"./{order_rel}",
                                   f"~/sky_workdir/{spec_rel}": f"./{spec_rel}",
                                   "~/sky_workdir/private/wl.py": "./private/wl.py",
                                   "~/sky_workdir/data/train.txt": "./data/train.txt",
                                   **{f"~/rentplan/{part}": f"{ROOT}/{part}" for part in SOURCE_PARTS}}


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_a_name_with_a_newline_is_refused_and_a_shell_word_stays_data(tmp_path, monkeypatch):
    root = user_project(tmp_path / "p")
    spec = yaml.safe_load((root / "campaign.yaml").read_text())
    spec["name"] = "evil\nenvs:\n  BASH_ENV: /tmp/x"
    (root / "campaign.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(root)
    r = CliRunner().invoke(cli, ["plan", "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out", "o"])
    assert r.exit_code == 1 and "name: 'evil\\nenvs:" in r.output and "U+000A" in r.output
    assert not (root / "o").exists()
    spec["name"] = "$(touch PWNED)"
    (root / "campaign.yaml").write_text(yaml.safe_dump(spec))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out", "o",
                                 "--offer", "vast-rtx_4090-1x"])
    assert r.exit_code == 0, r.output
    assert_sky_yaml_is_data(root / "o" / "sky.yaml", "o")
    r = CliRunner().invoke(cli, ["plan", "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out",
                                 "x;touch PWNED", "--offer", "vast-rtx_4090-1x"])
    assert r.exit_code == 0 and not (root / "PWNED").exists(), r.output  # mounted under a safe name: the test below
    assert "~/sky_workdir/.rentplan-launch/order/order.json" in mounts_of(root / "x;touch PWNED" / "sky.yaml")


@pytest.mark.slow
def test_module_workloads_sibling_modules_and_ignored_files_in_folders_all_arrive(tmp_path, monkeypatch):
    """A helper found: a package.module workload was not importable on the machine, a workload's sibling module
    and the git-ignored weights inside an hf: folder were left behind, and a missing data file was mounted."""
    root = git_project(tmp_path / "m", ["rentplan-out/", "rentplan.db", "private/", "*.safetensors"])
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "wl.py").write_text(WORKLOAD)
    (root / "private").mkdir()
    (root / "private" / "helper.py").write_text("X = 1\n")
    (root / "private" / "wl.py").write_text("from helper import X\n" + WORKLOAD)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")
    (root / "model" / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.chdir(root)
    for workload in ("mypkg.wl:make", "private/wl.py:make"):
        cfgs = [config(workload=workload, params_json=json.dumps({"data": "model"}), micro_batch=mb, seq_len=256,
                       eval_seq_len=256, eval_micro_batch=mb) for mb in (1, 2, 4)]
        write_ledger(root / "rentplan.db", [x for c in cfgs for x in pilot_lines(c, 100 * 2**20 + c.micro_batch)])
        (root / "c.yaml").write_text(campaign_yaml(workload=workload, params={"data": "model"}))
        r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "rentplan.db", "--out",
                                     "rentplan-out", "--offer", "vast-rtx_4090-1x"])
        assert r.exit_code == 0, r.output
        result = assert_launches(root, "rentplan-out", tmp_path / workload.replace("/", "_").replace(":", "_"))
        home = result["home"] / "sky_workdir"
        assert (home / "model" / "model.safetensors").exists()  # ignored, inside a mounted folder: named file by file
        assert (home / "private" / "helper.py").exists() == workload.startswith("private/")  # the workload's sibling
        assert "stub campaign run: will import make" in result["run"].stdout
    cfgs = [config(workload="private/wl.py:make", params_json=json.dumps({"data": "nowhere.txt"}), micro_batch=mb,
                   seq_len=256, eval_seq_len=256, eval_micro_batch=mb) for mb in (1, 2, 4)]
    write_ledger(root / "rentplan.db", [x for c in cfgs for x in pilot_lines(c, 100 * 2**20 + c.micro_batch)])
    (root / "c.yaml").write_text(campaign_yaml(workload="private/wl.py:make", params={"data": "nowhere.txt"}))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "rentplan.db", "--out", "o2",
                                 "--offer", "vast-rtx_4090-1x"])
    assert r.exit_code == 1 and "params.data" in r.output and "nowhere.txt does not exist" in r.output


@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_a_workload_module_outside_the_launch_folder_is_refused(tmp_path, monkeypatch):
    """A helper found: a package.module workload planned from another folder wrote a sky.yaml whose verify could
    not import it on the machine."""
    proj = tmp_path / "proj"
    (proj / "mypkg").mkdir(parents=True)
    (proj / "mypkg" / "__init__.py").write_text("")
    (proj / "mypkg" / "wl.py").write_text(WORKLOAD)
    cfgs = [config(workload="mypkg.wl:make", micro_batch=mb, seq_len=256, eval_seq_len=256, eval_micro_batch=mb)
            for mb in (1, 2, 4)]
    write_ledger(proj / "l.db", [x for c in cfgs for x in pilot_lines(c, 100 * 2**20 + c.micro_batch * 2**20)])
    (proj / "c.yaml").write_text(campaign_yaml(workload="mypkg.wl:make"))
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(proj / "c.yaml"), "--ledger", str(proj / "l.db"),
                                 "--out", "o", "--offer", "vast-rtx_4090-1x"])
    assert r.exit_code == 1 and "the workload module mypkg.wl is not in the launch folder" in r.output
    assert not (other / "o").exists()
    monkeypatch.chdir(proj)  # from the folder that holds it: its package files are mounted by name
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "o",
                                 "--offer", "vast-rtx_4090-1x"])
    assert r.exit_code == 0, r.output
    mounts = yaml.safe_load((proj / "o" / "sky.yaml").read_text())["file_mounts"]
    assert {"~/sky_workdir/mypkg/__init__.py", "~/sky_workdir/mypkg/wl.py"} <= set(mounts)


# ---------------------------------------------------------------- what is uploaded: links, names, sizes

def plan_in(root: Path, monkeypatch, *extra, out="o"):
    monkeypatch.chdir(root)
    return CliRunner().invoke(cli, ["plan", "--campaign", "campaign.yaml", "--ledger", "rentplan.db", "--out", out,
                                    "--offer", "vast-rtx_4090-1x", *extra])


def mounts_of(sky: Path) -> dict:
    return yaml.safe_load(sky.read_text())["file_mounts"]


@pytest.mark.parametrize("name, target", [("passwd.py", "etc/passwd"),
                                          pytest.param("id_rsa.py", "home/.ssh/id_rsa", marks=pytest.mark.slow),
                                          pytest.param("ssh.py", "home/.ssh", marks=pytest.mark.slow)])
def test_a_link_beside_the_workload_out_of_the_launch_folder_is_refused_by_name(tmp_path, monkeypatch, name, target):
    """User: `wl/passwd.py -> /etc/passwd` and `wl/id_rsa.py -> ~/.ssh/id_rsa` beside the workload ended up,
    contents and all, in SkyPilot's upload; a linked folder `wl/ssh.py -> ~/.ssh` had each file mounted."""
    outside = tmp_path / "outside"
    (outside / "home" / ".ssh").mkdir(parents=True)
    (outside / "home" / ".ssh" / "id_rsa").write_text("SECRET KEY")
    (outside / "etc").mkdir()
    (outside / "etc" / "passwd").write_text("root:x:0:0")
    root = user_project(tmp_path / "p")
    (root / "private" / name).symlink_to(outside / target)
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 1 and r.output.startswith("Error: "), r.output
    assert f"private/{name}" in r.output and "links to" in r.output and str(outside / target) in r.output, r.output
    assert not (root / "o").exists()


@pytest.mark.slow  # a plan per case: make test-slow and CI
def test_a_name_skyignore_lists_is_not_added_even_a_linked_folder(tmp_path, monkeypatch):
    """.skyignore is the user's word on what leaves the machine: rentplan adds no sibling it names (and, with it
    named, a linked folder beside the workload is no error)."""
    root = user_project(tmp_path / "p")
    (tmp_path / "ssh").mkdir()
    (tmp_path / "ssh" / "id_rsa").write_text("SECRET KEY")
    (root / "private" / "ssh.py").symlink_to(tmp_path / "ssh")
    (root / "private" / "notes_secret.py").write_text("TOKEN = 'x'\n")
    (root / "private" / "helper.py").write_text("X = 1\n")
    (root / ".skyignore").write_text("private/ssh.py\n*_secret.py\n")
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    mounts = mounts_of(root / "o" / "sky.yaml")
    assert "~/sky_workdir/private/helper.py" in mounts and "~/sky_workdir/private/wl.py" in mounts
    assert not [m for m in mounts if "ssh" in m or "secret" in m], mounts


def hf_cache_snapshot(parent: Path, weights_bytes: int) -> Path:
    """A model as the Hugging Face hub caches it: snapshots/REV/* are links into ../../blobs."""
    entry = parent / "models--org--tiny"
    (entry / "blobs").mkdir(parents=True)
    snap = entry / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (entry / "blobs" / "c0nf1g").write_text('{"model_type": "llama"}')
    with open(entry / "blobs" / "we1ght5", "wb") as f:
        f.truncate(weights_bytes)  # sparse: its size, not its bytes
    (snap / "config.json").symlink_to("../../blobs/c0nf1g")
    (snap / "model.safetensors").symlink_to("../../blobs/we1ght5")
    return snap


def hf_project(tmp_path: Path, snap_parent: Path, weights_bytes: int) -> tuple[Path, Path]:
    root = user_project(tmp_path / "p")
    snap = hf_cache_snapshot(snap_parent, weights_bytes)
    text = (root / "campaign.yaml").read_text().replace("private/wl.py:make", "private/wl.py:make")
    spec = yaml.safe_load(text)
    spec["params"]["data"] = str(snap)
    (root / "campaign.yaml").write_text(yaml.safe_dump(spec))
    import sqlite3

    with sqlite3.connect(root / "rentplan.db") as db:
        db.execute("UPDATE lines SET params_json = ?", (json.dumps(spec["params"], sort_keys=True),))
    return root, snap


@pytest.mark.slow  # a plan per case: make test-slow and CI
@pytest.mark.parametrize("where", ["inside", "home cache"])
def test_a_hugging_face_cache_snapshot_is_mounted_through_its_links_and_counted_on_the_disk(tmp_path, monkeypatch,
                                                                                           where):
    """User: an hf: folder laid out like the Hugging Face cache (files that are links into ../../blobs) had its
    links mounted unchecked and its 50 GB weights left out of disk_size. Links into the cache entry's own blobs are
    followed (mounted under the names the model reads, from the blob); disk_size counts every upload, and sky.yaml
    lists each with its size."""
    root, snap = hf_project(tmp_path, (tmp_path / "p" / "models") if where == "inside" else tmp_path / "cache",
                            50 * 10**9)
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    text = (root / "o" / "sky.yaml").read_text()
    mounts = mounts_of(root / "o" / "sky.yaml")
    weights = next(k for k in mounts if k.endswith("/model.safetensors"))
    assert mounts[weights].endswith("blobs/we1ght5")  # the file itself, not a link SkyPilot would copy as a link
    disk = yaml.safe_load(text)["resources"]["disk_size"]
    assert disk >= 100 + 47, disk  # 50e9 bytes = 46.6 GiB
    assert "uploads 46.57 GiB" in text and "model.safetensors\" 46.57 GiB" in text, text


@pytest.mark.slow  # a plan per case: make test-slow and CI
@pytest.mark.parametrize("bad", ["tokenizer.json -> /etc", "sub -> folder"])
def test_a_link_in_a_cache_snapshot_that_leaves_its_entry_is_refused(tmp_path, monkeypatch, bad):
    root, snap = hf_project(tmp_path, tmp_path / "cache", 1000)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0")
    if bad.startswith("tokenizer"):
        (snap / "tokenizer.json").symlink_to(tmp_path / "etc" / "passwd")
        name = "tokenizer.json"
    else:
        (tmp_path / "cache" / "models--org--tiny" / "blobs" / "d1r").mkdir()
        (snap / "sub").symlink_to("../../blobs/d1r")  # a linked folder: never walked, said
        name = "sub"
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 1 and r.output.startswith("Error: ") and name in r.output, r.output
    assert not (root / "o").exists()


@pytest.mark.slow  # a plan per case: make test-slow and CI
def test_a_huge_sibling_counts_on_the_disk(tmp_path, monkeypatch):
    """User: a 300 GB sibling of the workload was mounted with disk_size: 101."""
    root = user_project(tmp_path / "p")
    with open(root / "private" / "big_table.py", "wb") as f:
        f.truncate(300 * 10**9)
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    text = (root / "o" / "sky.yaml").read_text()
    assert yaml.safe_load(text)["resources"]["disk_size"] >= 100 + 280
    assert "\"private/big_table.py\" 279.40 GiB" in text


@pytest.mark.slow  # a plan per case: make test-slow and CI
@pytest.mark.parametrize("sibling", ["my notes.py", "café.py"])
def test_a_sibling_sky_yaml_cannot_name_leaves_only_sky_yaml_out(tmp_path, monkeypatch, sibling):
    """User: a sibling named `my notes.py` or `café.py` refused the whole plan. The sheet, the plans and the order
    are written; only sky.yaml (and the campaign it runs) is left out, with the reason on stdout and the sheet."""
    root = user_project(tmp_path / "p")
    (root / "private" / sibling).write_text("X = 1\n")
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    out = root / "o"
    assert (out / "order.json").exists() and (out / "order_sheet.md").exists() and (out / "plans.csv").exists()
    assert not (out / "sky.yaml").exists() and not (out / "order-campaign.yaml").exists()
    for text in (r.output, (out / "order_sheet.md").read_text()):
        assert "no sky.yaml" in text and sibling in text, text


@pytest.mark.slow  # six plans: make test-slow and CI
@pytest.mark.parametrize("out", ["o_é", "o_☃ ü", "my orders", "x;touch PWNED", "-o", "~"])
def test_an_out_folder_of_any_name_still_launches(tmp_path, monkeypatch, out):
    """User: `plan --out o_é` or `--out "o_☃ ü"` refused the whole plan. The order's own files are rentplan's to
    name on the machine: they go under a safe name there, and sky.yaml's verify names that path."""
    root = user_project(tmp_path / "p")
    r = plan_in(root, monkeypatch, out=out)
    assert r.exit_code == 0, r.output
    task = yaml.safe_load((root / out / "sky.yaml").read_text())
    verify = shlex.split(task["run"].splitlines()[3])
    assert verify[:2] == ["rentplan", "verify"] and f"~/sky_workdir/{verify[2]}" in task["file_mounts"]
    assert task["file_mounts"][f"~/sky_workdir/{verify[2]}"] == f"./{out}/order.json"
    assert not (root / "PWNED").exists()


@pytest.mark.slow
@pytest.mark.parametrize("out", ["$(touch PWNED)", "o'q\"", "a`id`"])
def test_an_out_folder_a_shell_would_read_leaves_only_sky_yaml_out(tmp_path, monkeypatch, out):
    root = user_project(tmp_path / "p")
    r = plan_in(root, monkeypatch, out=out)
    assert r.exit_code == 0, r.output
    assert (root / out / "order.json").exists() and not (root / out / "sky.yaml").exists()
    assert "no sky.yaml" in r.output and not (root / "PWNED").exists()


@pytest.mark.slow  # a plan per case: make test-slow and CI
def test_the_rentplan_source_passes_the_same_checks(tmp_path, monkeypatch):
    """User: a rentplan checkout under `x$(touch SRC_PWNED) q` went into file_mounts unchecked."""
    src = tmp_path / "x$(touch SRC_PWNED) q"
    src.mkdir()
    monkeypatch.setattr("planner.outputs.skypilot.rentplan_source", lambda: str(src))
    root = user_project(tmp_path / "p")
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    assert (root / "o" / "order.json").exists() and not (root / "o" / "sky.yaml").exists()
    assert "no sky.yaml" in r.output and "rentplan source" in r.output, r.output


def test_what_rentplan_adds_is_only_what_it_means_to(tmp_path, monkeypatch):
    """A helper's attacks: a link beside the workload to a file .skyignore lists (`wl/cfg.py -> ../.env`) carried
    the secret; a folder named `keys.py` was walked and a FIFO `pipe.py` mounted; the rentplan source went up whole
    (its .git and a stray key), unlisted and uncounted."""
    root = user_project(tmp_path / "p")
    (root / ".env").write_text("AWS_SECRET=zzz\n")
    (root / ".skyignore").write_text(".env\n")
    (root / "private" / "cfg.py").symlink_to("../.env")
    (root / "private" / "keys.py").mkdir()
    (root / "private" / "keys.py" / "id_rsa").write_text("KEY")
    os.mkfifo(root / "private" / "pipe.py")
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    text = (root / "o" / "sky.yaml").read_text()
    mounts = mounts_of(root / "o" / "sky.yaml")
    assert not [m for m in mounts if any(w in m for w in ("cfg.py", "keys.py", "pipe.py"))], mounts
    assert not [src for src in mounts.values() if ".env" in src or ".git" in src]
    source = {k: v for k, v in mounts.items() if k.startswith("~/rentplan")}
    assert set(source) == {f"~/rentplan/{p}" for p in SOURCE_PARTS if (ROOT / p).exists()}
    assert "~/rentplan (this rentplan's source" in text  # listed with its size, and counted in the disk


@pytest.mark.slow  # a plan per case: make test-slow and CI
@pytest.mark.parametrize("held", [".ssh", ".aws"])
def test_a_launch_folder_holding_keys_gets_no_sky_yaml(tmp_path, monkeypatch, held):
    """Planning from a home folder: sky.yaml's workdir (the launch folder, uploaded whole) would carry ~/.ssh and
    ~/.aws to the rented machine."""
    root = user_project(tmp_path / "p")
    (root / held).mkdir()
    (root / held / "credentials").write_text("SECRET")
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0 and (root / "o" / "order.json").exists() and not (root / "o" / "sky.yaml").exists()
    assert f"holds {held}" in r.output and "no sky.yaml" in r.output, r.output


@pytest.mark.slow  # a plan per case: make test-slow and CI
def test_a_workload_outside_the_launch_folder_travels_with_its_subpackages(tmp_path, monkeypatch):
    """A fresh-clone user (#44): a workload in another folder importing `from pkg.acts import ACT` got sky.yaml
    mounts of its .py siblings only, and on the machine: ModuleNotFoundError: No module named 'pkg'."""
    root = user_project(tmp_path / "p")
    elsewhere = tmp_path / "gitproj"
    (elsewhere / "pkg").mkdir(parents=True)
    (elsewhere / "pkg" / "__init__.py").write_text("")
    (elsewhere / "pkg" / "acts.py").write_text("ACT = 'relu'\n")
    (elsewhere / "wl.py").write_text("from pkg.acts import ACT\n" + WORKLOAD)
    spec = yaml.safe_load((root / "campaign.yaml").read_text())
    spec["workload"] = f"{elsewhere}/wl.py:make"
    (root / "campaign.yaml").write_text(yaml.safe_dump(spec))
    import sqlite3

    with sqlite3.connect(root / "rentplan.db") as db:
        db.execute("UPDATE lines SET workload = ?", (f"{elsewhere}/wl.py:make",))
    r = plan_in(root, monkeypatch)
    assert r.exit_code == 0, r.output
    mounts = mounts_of(root / "o" / "sky.yaml")
    wl = next(k for k, v in mounts.items() if v == str(elsewhere / "wl.py"))
    base = wl.rsplit("/", 1)[0]
    assert mounts.get(f"{base}/pkg/acts.py") == str(elsewhere / "pkg" / "acts.py"), mounts
    assert mounts.get(f"{base}/pkg/__init__.py") == str(elsewhere / "pkg" / "__init__.py"), mounts
