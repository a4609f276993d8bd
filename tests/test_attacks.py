"""Nothing runs, changes or is lost that the user did not ask for (issue 15). One table-driven test per class of
attack, written as a new user (or a hostile data file) would try it. Each attack must end in exit 0, or exit 1
with `Error:` and no traceback, and must leave its input files as they were."""

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.conftest import ROOT
from tests.factories import campaign_yaml, standard_ledger


def digest(paths) -> dict:
    return {str(p): hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths if Path(p).is_file()}


def attack(args, inputs=(), code=1, says=None, cwd=None):
    """Run a command; it must exit `code` with `Error:` (when 1) and no traceback; inputs stay unchanged."""
    before = digest(inputs)
    r = CliRunner().invoke(cli, [str(a) for a in args])
    out = r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception), out)
    assert "Traceback" not in out, out
    if code is not None:
        assert r.exit_code == code, (args, r.exit_code, out)
    if code == 1:
        assert "Error: " in out or "do not adopt" in out, out
    if says:
        assert says in out, (says, out)
    assert digest(inputs) == before, f"{args} changed an input file"
    return r


# ---------------------------------------------------------------- code from data files

CODE_REFS = [
    ("os:system", "standard library"),
    pytest.param("subprocess:run", "standard library", marks=pytest.mark.slow),  # 6 s: its own process
    ("builtins:eval", "standard library"),
    ("pandas:read_pickle", "installed package"),
    ("yaml:load", "installed package"),
    ("/etc/passwd:fn", "not a .py file"),
]


@pytest.mark.parametrize("ref,why", CODE_REFS)
def test_a_workload_reference_never_names_code_outside_the_users_own(tmp_path, ref, why):
    marker = tmp_path / "ran"
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"workload: '{ref}'\nparams: {{command: 'touch {marker}'}}\nmicro_batch: 1\nseq_len: 8\n")
    attack(["probe", "--grid", grid, "--ledger", tmp_path / "l.db", "--device", "cpu"], [grid], says=why)
    assert not marker.exists()
    camp = tmp_path / "c.yaml"
    camp.write_text(campaign_yaml().replace("workload: builtin:gpt", f"workload: '{ref}'"))
    attack(["campaign", "run", camp, "--ledger", tmp_path / "l.db", "--out", tmp_path / "runs"], [camp], says=why)
    assert not marker.exists()


def test_a_reexported_function_is_not_the_users_own(tmp_path):
    (tmp_path / "wl.py").write_text("from os import system\nfrom shutil import rmtree as make\n")
    attack(["inspect", "-w", f"{tmp_path / 'wl.py'}:system"], says="not a Python function or class")
    attack(["inspect", "-w", f"{tmp_path / 'wl.py'}:make"], says="not defined in")


def test_a_workload_that_exits_at_import_gets_an_error(tmp_path):
    (tmp_path / "wl.py").write_text("import sys\nsys.exit(3)\n")
    attack(["inspect", "-w", f"{tmp_path / 'wl.py'}:make"], says="sys.exit")


@pytest.mark.slow  # a process per case
@pytest.mark.parametrize("code", ["import os\nos._exit(0)\n", "from os import _exit\n_exit(5)\n"])
def test_a_workload_that_calls_os_exit_at_import_gets_an_error_not_a_silent_end(tmp_path, code):
    """os._exit skips every handler: without a guard, `inspect` (which imports the workload itself) ended with
    status 0 and no word. A real process, as the user runs it."""
    import subprocess
    import sys

    (tmp_path / "wl.py").write_text(code)
    r = subprocess.run([sys.executable, "-m", "planner.cli", "inspect", "-w", f"{tmp_path / 'wl.py'}:make"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "called os._exit(" in r.stderr + r.stdout, (r.returncode, r.stderr[-500:])
    import os
    assert os._exit.__name__ == "_exit"  # restored in this process too (the import helper is shared)


# ---------------------------------------------------------------- files changed by commands that fail or only read

def skypilot_csv(path, price="2.5", spot="", encoding="utf-8", extra=""):
    path.write_bytes(("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,Region\n"
                      f"gpu_1x_h100,H100,1,26,200,{price},{spot},us-east-1\n{extra}").encode(encoding))
    return path


@pytest.mark.parametrize("command", [["inspect"],
                                     ["probe", "--micro-batch", "1", "--seq-len", "8", "--ledger", "l.db"]])
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
    r = subprocess.run([sys.executable, "-m", "planner.cli", *command, "-w", "forky.py:tiny"], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Error:" in out and "os.fork" in out and "Traceback" not in out, out[-800:]
    time.sleep(2.5)
    assert not marker.exists(), "a process forked at import outlived the command"


def test_catalog_import_validates_before_it_writes(tmp_path):
    out = tmp_path / "mycat.yaml"
    out.write_text("keep me\n")
    bad_as_of = ["catalog", "import", "--skypilot", skypilot_csv(tmp_path / "vms.csv"), "--provider", "p",
                 "--as-of", "", "--out", out]
    attack(bad_as_of, [out, tmp_path / "vms.csv"])
    assert out.read_text() == "keep me\n"
    # a catalog whose offers come first: the merge must still land under offers:, and validate
    import yaml

    doc = yaml.safe_load(open("catalog.yaml"))
    first = tmp_path / "offers-first.yaml"
    first.write_text(yaml.safe_dump({"offers": doc["offers"], "gpus": doc["gpus"]}, sort_keys=False))
    merged = tmp_path / "merged.yaml"
    attack(["catalog", "import", "--skypilot", tmp_path / "vms.csv", "--provider", "p", "--as-of", "2026-12-01",
            "--catalog", first, "--out", merged], [first], code=0)
    assert len(yaml.safe_load(merged.read_text())["offers"]) == len(doc["offers"]) + 1


def test_read_commands_never_change_a_foreign_sqlite_file(tmp_path):
    db = tmp_path / "other.db"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (x)")
    con.commit()
    con.close()
    for args in (["ledger", "show", "--ledger", db], ["campaign", "report", "--ledger", db],
                 ["plan", "--campaign", "planner/examples/lr-comparison.yaml", "--ledger", db]):
        attack(args, [db], says="not a rentplan ledger")
    con = sqlite3.connect(db)
    assert [r[0] for r in con.execute("SELECT name FROM sqlite_master")] == ["t"]
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_a_ledger_of_a_newer_schema_is_refused_and_an_older_one_backed_up(tmp_path):
    led = standard_ledger(tmp_path / "l.db")
    con = sqlite3.connect(led)
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    attack(["ledger", "show", "--ledger", led], [led], says="newer")
    attack(["probe", "--micro-batch", "1", "--seq-len", "8", "--ledger", led, "--device", "cpu"], [led],
           says="newer")


@pytest.mark.slow
def test_temporary_checkpoints_of_a_killed_run_are_cleaned_by_the_next(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import tempfile

    from planner.inputs.grid import GridSpec, build_grid
    from probes.runner import run_grid

    dead = 2**22 + 4321  # above pid_max: no such process
    stale = tmp_path / f"rentplan-pilot-{dead}-abcd"
    stale.mkdir()
    (stale / "r-1.ckpt.pt").write_bytes(b"x" * 1000)
    half = tmp_path / f"r-2.ckpt.pt.tmp-{dead}"
    half.write_bytes(b"y")
    mine = tmp_path / f"rentplan-pilot-{os.getpid()}-live"
    mine.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfgs = build_grid(GridSpec(workload="builtin:gpt", params={"layers": 1, "d_model": 16, "heads": 2, "vocab": 32},
                               micro_batch=[1], seq_len=[8], eval_seq_len=[8], device="cpu"))
    said = []
    run_grid(cfgs, str(tmp_path / "l.db"), progress=said.append)
    assert not stale.exists() and not half.exists() and mine.exists()
    assert any(stale.name in s for s in said)


# ---------------------------------------------------------------- integrity

def finished_run(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(textwrap.dedent("""
        name: tiny
        workload: builtin:gpt
        params: {layers: 1, d_model: 16, heads: 2, vocab: 32}
        seq_len: 8
        effective_batch: 2
        micro_batch: 2
        updates: 2
        eval: {every_updates: 2, examples: 2, seq_len: 8}
        precision: fp32
        variants: [{id: control, lr: 1.0e-3}]
    """))
    led, out = tmp_path / "l.db", tmp_path / "runs"
    r = CliRunner().invoke(cli, ["campaign", "run", str(spec), "--ledger", str(led), "--out", str(out)])
    assert r.exit_code == 0, r.output
    run_id = r.output.split("c-", 1)[1].split()[0]
    return f"c-{run_id}", led, out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    pytest.importorskip("torch")
    return finished_run(tmp_path_factory.mktemp("run"))


def test_integrity_attacks(run_dir, tmp_path):
    run_id, led, out = run_dir
    import shutil

    work = tmp_path / "copy"
    shutil.copytree(out, work)
    weights = work / run_id / "model.safetensors"
    # 1. finish compares the weights' sha256 with the one the run recorded
    from safetensors.torch import load_file, save_file

    w = load_file(weights)
    save_file({k: v for k, v in w.items()}, str(weights), metadata={"changed": "yes"})  # same tensors, new bytes
    attack(["campaign", "finish", run_id, "--ledger", led, "--out", work], [weights], says="sha256")
    # 2. an archive into a folder that already holds files is refused
    dest = tmp_path / "a"
    dest.mkdir()
    (dest / "mine.txt").write_text("mine")
    attack(["archive", run_id, "--to", dest, "--ledger", led, "--out", out], [dest / "mine.txt"], says="not empty")
    # 3. manifests that name paths outside the archive, or symlinks, are refused
    good = tmp_path / "good"
    CliRunner().invoke(cli, ["archive", run_id, "--to", str(good), "--ledger", str(led), "--out", str(out)])
    manifest = json.loads((good / "manifest.json").read_text())
    for name in ("../outside.txt", "/etc/passwd"):
        evil = tmp_path / f"evil{len(name)}"
        shutil.copytree(good, evil)
        m = json.loads(json.dumps(manifest))
        m["files"][name] = {"sha256": "0" * 64, "bytes": 1}
        (evil / "manifest.json").write_text(json.dumps(m))
        attack(["archive", "verify", evil], [evil / "manifest.json"], says="outside the archive")
    linked = tmp_path / "linked"
    shutil.copytree(good, linked)
    (linked / "README.md").unlink()
    (linked / "README.md").symlink_to(good / "README.md")
    attack(["archive", "verify", linked], says="symlink")
    # 4. a manifest recomputed after tampering is caught by the ledger's recorded sha256
    forged = tmp_path / "forged"
    shutil.copytree(good, forged)
    w = load_file(forged / "model.safetensors")
    k = next(iter(w))
    w[k] = w[k] + 1
    save_file(w, str(forged / "model.safetensors"))
    from planner.tools.archive import sha256

    m = json.loads((forged / "manifest.json").read_text())
    m["files"]["model.safetensors"]["sha256"] = sha256(forged / "model.safetensors")
    (forged / "manifest.json").write_text(json.dumps(m))
    r = attack(["archive", "verify", forged], code=0)
    assert "manifest only" in r.output  # without the ledger it can only say what it checked against
    attack(["archive", "verify", forged, "--ledger", led], says="the ledger recorded")
    ok = attack(["archive", "verify", good, "--ledger", led], code=0)
    assert "ledger" in ok.output


# ---------------------------------------------------------------- concurrency

@pytest.mark.slow
def test_a_claimed_configuration_is_skipped_by_a_second_probe(tmp_path):
    pytest.importorskip("torch")
    from planner.inputs.grid import GridSpec, build_grid
    from planner.ledger import Ledger
    from probes.runner import run_grid

    led = tmp_path / "l.db"
    (cfg,) = build_grid(GridSpec(workload="builtin:gpt", params={"layers": 1, "d_model": 16, "heads": 2,
                                                                   "vocab": 32},
                                 micro_batch=[1], seq_len=[8], eval_seq_len=[8], device="cpu"))
    with Ledger(led) as ledger:
        assert ledger.claim(cfg.key(), "other-run", pid=os.getppid(), host=os.uname().nodename) is None  # taken
    said = []
    res = run_grid([cfg], str(led), progress=said.append)
    assert res.run_ids == [] and any("claimed by" in s for s in said)
    with Ledger(led) as ledger:
        ledger.release(cfg.key(), "other-run")
        assert ledger.claim(cfg.key(), "dead-run", pid=2**22 + 12345, host=os.uname().nodename) is None  # pid gone
    res = run_grid([cfg], str(led), progress=said.append)
    assert len(res.run_ids) == 1  # a claim whose process is gone is taken over


# ---------------------------------------------------------------- values

def campaign_with(tmp_path, old, new):
    c = tmp_path / "c.yaml"
    c.write_text(campaign_yaml().replace(old, new))
    return c


VALUES = [
    ("effective_batch: 16", "effective_batch: 1e29", "effective_batch"),
    ("setup_hours: 1", "setup_hours: 1e308", "setup_hours"),
    ("updates: 200", "updates: 1e12", "updates"),
]


@pytest.mark.parametrize("old,new,key", VALUES)
def test_absurd_campaign_values_are_refused(tmp_path, old, new, key):
    c = campaign_with(tmp_path, old, new)
    attack(["plan", "--campaign", c, "--ledger", standard_ledger(tmp_path / "l.db")], [c], says=key)


def test_a_string_number_still_has_to_divide(tmp_path):
    c = tmp_path / "c.yaml"
    c.write_text(campaign_yaml().replace("effective_batch: 16", "effective_batch: 1e1\nmicro_batch: 3"))
    attack(["plan", "--campaign", c, "--ledger", standard_ledger(tmp_path / "l.db")], [c],
           says="3 does not divide effective_batch 10")


OPTIONS = [
    (["probe", "--timeout", "-5"], "--timeout"),
    (["probe", "--effective-batch", "0"], "--effective-batch"),
    (["probe", "--nproc", "0"], "--nproc"),
    (["estimate", "--nproc", "0"], "--nproc"),
    (["probe", "--device", "cuda"], "no CUDA device"),
    (["probe", "--device", "tpu"], "--device"),
]


@pytest.mark.parametrize("args,says", OPTIONS)
def test_bad_options_are_refused_before_anything_runs(tmp_path, args, says):
    led = tmp_path / "l.db"
    attack([*args, "--ledger", led], says=says)
    assert not led.exists()


CATALOG_VALUES = [
    ("memory_gib_usable: 22.49", "memory_gib_usable: 1e-12", "memory_gib_usable"),
    ("gpus_per_instance: 1\n", "gpus_per_instance: 1\n    nodes: '2'\n", "nodes"),
    ("bf16_dense_tflops: 121", "bf16_dense_tflops: 'fast'", "bf16_dense_tflops"),
]


def l4_catalog(tmp_path, old=None, new=None):
    text = textwrap.dedent("""
        gpus:
          - id: l4
            name: NVIDIA L4
            vendor: nvidia
            memory_gb_marketed: 24
            memory_gib_usable: 22.49
            mem_bandwidth_tbps: 0.3
            bf16_supported: true
            fp8_supported: true
            bf16_dense_tflops: 121
            fp32_tflops: 30.3
            compute_capability: '8.9'
        offers:
          - id: l4-1
            gpu: l4
            provider: test
            gpus_per_instance: 1
            price_per_instance_hour_usd: 0.8
            spot: false
            as_of: '2026-12-01'
            source: test
    """)
    if old:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "cat.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("old,new,key", CATALOG_VALUES + [("offers:\n  - id: l4-1", "offers: []\nx:\n  - id: l4-1",
                                                           "")])
def test_catalog_values_that_validate_also_plan(tmp_path, old, new, key):
    cat = l4_catalog(tmp_path, old, new) if key else l4_catalog(tmp_path)
    if not key:  # no offers at all
        cat.write_text(cat.read_text().split("offers:")[0] + "offers: []\n")
    v = CliRunner().invoke(cli, ["catalog", "validate", str(cat)])
    p = CliRunner().invoke(cli, ["plan", "--campaign", "planner/examples/lr-comparison.yaml", "--catalog", str(cat),
                                 "--ledger", standard_ledger(tmp_path / "l.db")])
    for r in (v, p):
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    # one schema: validate refuses exactly what plan cannot use
    assert (v.exit_code == 0) == (p.exit_code == 0), (v.output, p.output)
    if key:
        assert key in v.output


# ---------------------------------------------------------------- tracebacks instead of Error:

def test_unreadable_inputs_give_errors(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    complex_key = tmp_path / "ck.yaml"
    complex_key.write_text("? [a, b]\n: 1\n")
    csv_latin = skypilot_csv(tmp_path / "latin.csv", encoding="latin-1", extra="x,H\xe9,1,1,1,1,,r\n")
    csv_spot = skypilot_csv(tmp_path / "spot.csv", spot="cheap")
    giant = skypilot_csv(tmp_path / "giant.csv", extra="x,H100,1,1,1,1,," + "r" * 200_000 + "\n")
    order = tmp_path / "order.json"
    order.write_text('{"format": "rentplan-order/1", "expect": 3, "settings": [], "plan": null}')
    manifest = tmp_path / "arch"
    manifest.mkdir()
    (manifest / "manifest.json").write_text('{"files": 5}')
    cases = [
        ["plan", "--campaign", latin, "--ledger", standard_ledger(tmp_path / "l.db")],
        ["catalog", "validate", latin],
        ["catalog", "validate", complex_key],
        ["probe", "--grid", complex_key],
        ["catalog", "import", "--skypilot", csv_latin, "--provider", "p", "--as-of", "2026-12-01"],
        ["catalog", "import", "--skypilot", giant, "--provider", "p", "--as-of", "2026-12-01"],
        ["verify", order, "--skip-pilot"],
        ["archive", "verify", manifest],
        ["inspect", "-w", "/etc/passwd:fn"],
        ["split", latin],
    ]
    for args in cases:
        attack(args, [a for a in args if isinstance(a, Path)])
    r = attack(["catalog", "import", "--skypilot", csv_spot, "--provider", "p", "--as-of", "2026-12-01"], [csv_spot],
               code=0)
    assert "SpotPrice" in r.output


def test_output_folders_that_cannot_be_written_give_errors(tmp_path):
    led = standard_ledger(tmp_path / "l.db")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    try:
        for out in (ro / "out", blocker / "out"):
            if os.geteuid() == 0 and out.parent == ro:
                continue  # root writes anywhere
            attack(["plan", "--campaign", "planner/examples/lr-comparison.yaml", "--ledger", led, "--out", out])
        attack(["ledger", "export", "--ledger", led, "--to", blocker / "x.csv"])
    finally:
        ro.chmod(0o700)


# ---------------------------------------------------------------- verify

def an_order(tmp_path) -> dict:
    camp = tmp_path / "camp.yaml"
    camp.write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(camp), "--ledger", standard_ledger(tmp_path / "o.db"),
                                 "--out", str(tmp_path / "plan-out")])
    assert r.exit_code == 0, r.output
    return json.loads((tmp_path / "plan-out" / "order.json").read_text())


@pytest.mark.slow
def test_verify_refuses_invalid_orders(tmp_path):
    made = an_order(tmp_path)
    for change, says in ((("expect", "device_kind", "tpu"), "device_kind"),
                         (("settings", "precision", "fp64"), "precision"),
                         (("stack", "packages", "torch"), "packages")):
        order = json.loads(json.dumps(made))
        section, key, value = change
        if key is None:
            order[section] = value
        else:
            order[section][key] = value
        path = tmp_path / "order.json"
        path.write_text(json.dumps(order))
        attack(["verify", path, "--skip-pilot"], [path], says=says)


@pytest.mark.slow
def test_verify_says_which_workload_it_will_import_and_refuses_a_foreign_one(tmp_path):
    made = an_order(tmp_path)
    path = tmp_path / "order.json"
    path.write_text(json.dumps(made))
    r = attack(["verify", path, "--skip-pilot"], [path], code=None)
    assert "[ok  ] workload: builtin:gpt (rentplan's own)" in r.output
    made["settings"]["workload"] = "os:system"
    path.write_text(json.dumps(made))
    r = attack(["verify", path, "--skip-pilot"], [path], says="standard library")
    assert "[FAIL] workload" in r.output


def test_an_older_ledger_is_backed_up_before_it_is_migrated(tmp_path):
    from planner.ledger import Ledger

    led = standard_ledger(tmp_path / "l.db")
    con = sqlite3.connect(led)
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.execute("DROP TABLE campaign_predictions")
    con.commit()
    con.close()
    attack(["ledger", "show", "--ledger", led], [led], code=0)  # read as it is, untouched
    with Ledger(led) as ledger:  # a command that writes migrates it, after a backup
        backup = ledger.backup
        assert "campaign_predictions" in {r[0] for r in ledger.db.execute("SELECT name FROM sqlite_master")}
    assert backup.name == "l.db.schema1.bak" and backup.is_file()
    con = sqlite3.connect(backup)
    assert con.execute("SELECT value FROM meta").fetchone()[0] == "1"
    assert con.execute("SELECT COUNT(*) FROM lines").fetchone()[0] > 0


@pytest.mark.slow
def test_two_probes_on_one_ledger_run_each_configuration_once(tmp_path):
    """The user's steps: two terminals start the same probe on one ledger at once."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    from planner.ledger import read_lines
    from tests.conftest import ROOT

    led = tmp_path / "l.db"
    args = [sys.executable, "-m", "planner", "probe", "--micro-batch", "1,2,3", "--seq-len", "8",
            "--eval-seq-len", "8", "-p", "layers=1", "-p", "d_model=16", "-p", "heads=2", "-p", "vocab=32",
            "--ledger", str(led), "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    df = read_lines(led)
    runs = df.groupby("config_key")["run_id"].nunique()
    assert len(runs) == 3 and (runs == 1).all(), runs  # three configurations, one run each
    said = "".join(err for _, err in outs)
    assert "claimed by run" in said or "finished by another probe" in said or "skip" in said


# ---------------------------------------------------------------- caps and processes

RUNAWAY = '''
import torch
from torch import nn

HOG, CALLS = [], [0]


class Runaway:
    name = "runaway"

    def build_model(self):
        return nn.Linear(16, 4)

    def make_batch(self, split, index, micro_batch, seq_len):
        g = torch.Generator().manual_seed(index)
        return {"x": torch.randn(micro_batch, 16, generator=g), "y": torch.randint(0, 4, (micro_batch,), generator=g)}

    def compute_loss(self, model, batch):
        CALLS[0] += 1
        while CALLS[0] >= 2:  # from the second update on it allocates until something stops it
            HOG.append(torch.ones(16 * 1024 * 1024))
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def make():
    return Runaway()
'''


def test_a_workload_that_keeps_allocating_past_the_cap_ends_oom_not_timeout(tmp_path):
    """The user's steps: `probe -w runaway.py:make --cap 300MiB`. The real steady update stops at the cap, but the
    census pass before it (fake tensors) held no cap, so it allocated until the worker's timeout, growing the
    worker's memory all the while. Now the census holds the run's cap: the line says oom, well within the timeout."""
    from planner.ledger import Ledger

    (tmp_path / "runaway.py").write_text(RUNAWAY)
    led = tmp_path / "l.db"
    t0 = time.monotonic()
    r = CliRunner().invoke(cli, ["probe", "-w", f"{tmp_path / 'runaway.py'}:make", "--micro-batch", "2",
                                 "--seq-len", "8", "--cap", "300MiB", "--ledger", str(led), "--timeout", "60"])
    took = time.monotonic() - t0
    assert r.exit_code == 0, r.output
    with Ledger(led, create=False) as ledger:
        lines = {row.phase: row for row in ledger.frame().itertuples()}
    assert lines["first_step"].verdict == "ok"
    assert lines["steady"].verdict == "oom", (lines["steady"].verdict, lines["steady"].detail)
    assert "cap exceeded" in lines["steady"].detail, lines["steady"].detail
    assert took < 50, f"{took:.0f} s: the census ran until the worker's timeout"
