"""The campaign does what the pilot guide asks (issue 14), each test written from a user's steps:
memory fixes as judged variants, divergence always judged, one budget per comparison, retries kept visible,
honest exit codes, paths from the spec's folder, data splits and truncation, predictions, archives, start-up."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.ledger import Ledger

pytest.importorskip("torch")

HEAD = """
name: guide
workload: builtin:gpt
params: {layers: 1, d_model: 32, heads: 2, vocab: 64}
seq_len: 32
effective_batch: 16
micro_batch: 8
updates: 6
eval: {every_updates: 3, examples: 16, seq_len: 32}
precision: fp32
"""


def run(*args, ok=True, **kw):
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, **kw)
    if ok:
        assert r.exit_code == 0, r.output
    return r


def spec(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def tables(led):
    with Ledger(led) as ledger:
        return {t: ledger.table(t) for t in ("campaign_runs", "campaign_events", "campaign_metrics",
                                             "campaign_predictions")}


def report_rows(led):
    return json.loads(run("campaign", "report", "--ledger", led, "--format", "json").stdout)


# ---------------------------------------------------------------- 1. memory fixes as judged variants

def test_memory_fix_variants_hold_the_effective_batch_and_get_a_quality_verdict(tmp_path):
    path = spec(tmp_path, HEAD + """
quality_target: {metric: val_loss, max_worse: 0.02}
variants:
  - {id: control, lr: 1.0e-3}
  - {id: micro-2, lr: 1.0e-3, micro_batch: 2}
  - {id: ckpt, lr: 1.0e-3, checkpointing: true}
  - {id: seed-7, lr: 1.0e-3, seed: 7}
""")
    led = tmp_path / "l.db"
    run("campaign", "run", path, "--ledger", led, "--out", tmp_path / "runs")
    t = tables(led)
    configs = {r.variant: json.loads(r.config_json)["config"] for r in t["campaign_runs"].itertuples()}
    assert {v: (c["micro_batch"], c["grad_accum"]) for v, c in configs.items()} == \
        {"control": (8, 2), "micro-2": (2, 8), "ckpt": (8, 2), "seed-7": (8, 2)}
    assert dict(zip(t["campaign_runs"]["variant"], t["campaign_runs"]["seed"]))["seed-7"] == 7
    assert configs["ckpt"]["checkpointing"] and not configs["control"]["checkpointing"]
    rows = {r["variant"]: r for r in report_rows(led)}
    assert rows["micro-2"]["changes"] == "micro_batch 2 (accumulation 8)"
    assert rows["ckpt"]["changes"] == "checkpointing on"
    assert rows["micro-2"]["quality"] == "holds" and rows["ckpt"]["quality"] == "holds"
    assert rows["control"]["quality"] == "control"
    said = run("campaign", "report", "--ledger", led).stdout
    assert "quality target (val_loss at most 2 % worse than the control's seed mean): micro-2 holds, ckpt holds" \
        in said
    assert rows["seed-7"]["changes"] == ""  # a seed is not a setting: the same question, another draw


def test_a_quality_target_that_fails_says_so(tmp_path):
    path = spec(tmp_path, HEAD + """
quality_target: {metric: val_loss, max_worse: 0.0}
variants:
  - {id: control, lr: 3.0e-3}
  - {id: slow, lr: 1.0e-6}
""")
    led = tmp_path / "l.db"
    run("campaign", "run", path, "--ledger", led, "--out", tmp_path / "runs")
    rows = {r["variant"]: r for r in report_rows(led)}
    assert rows["slow"]["quality"].startswith("fails: val_loss ")


def test_variants_still_may_not_change_the_question(tmp_path):
    path = spec(tmp_path, HEAD + """
variants:
  - {id: control, lr: 1.0e-3}
  - {id: bigger, lr: 1.0e-3, updates: 12, micro_batch: 3}
""")
    r = run("campaign", "run", path, "--ledger", tmp_path / "l.db", ok=False)
    assert r.exit_code == 1
    assert "variants[1].updates: a variant may change only lr, micro_batch, checkpointing, precision" in r.output
    assert "variants[1].micro_batch: 3 does not divide effective_batch 16" in r.output


def test_the_example_spec_of_memory_fixes_is_valid():
    from planner.cli import example_campaign_path
    from planner.inputs.campaign_spec import load_campaign

    camp = load_campaign(example_campaign_path("memory-fixes.yaml"))
    assert camp.quality_target is not None
    assert {k for v in camp.variants for k in camp.changed(v)} >= {"micro_batch", "checkpointing", "precision"}


# ---------------------------------------------------------------- 2. divergence is always judged

DIVERGE = HEAD.replace("updates: 6", "updates: 12") + """
variants:
  - {id: control, lr: 1.0e-3}
  - {id: hot, lr: 10}
"""


def test_an_lr_that_diverges_with_no_stop_rule_is_marked_diverged(tmp_path):
    led = tmp_path / "l.db"
    r = run("campaign", "run", spec(tmp_path, DIVERGE), "--ledger", led, "--out", tmp_path / "runs")
    rows = {x["variant"]: x for x in report_rows(led)}
    assert rows["hot"]["status"].startswith("diverged at update ")
    assert rows["control"]["status"] == "finished"
    assert "1 diverged" in r.output  # the summary line; a divergence is a result: exit 0
    said = run("campaign", "report", "--ledger", led).stdout
    assert "hot (lr 10) diverged at update" in said


def test_a_diverged_run_keeps_running_when_the_stop_rules_say_so(tmp_path):
    led = tmp_path / "l.db"
    text = DIVERGE.replace("variants:", "stop_if: {diverged: false}\nvariants:")
    run("campaign", "run", spec(tmp_path, text), "--variant", "hot", "--ledger", led, "--out", tmp_path / "runs")
    t = tables(led)
    assert len(t["campaign_metrics"].query("kind == 'train'")) == 12  # it ran every update
    (row,) = json.loads(run("campaign", "report", "--ledger", led, "--format", "json").stdout)
    assert row["status"].startswith("diverged at update ") and "ran on to update 12" in row["status"]


# ---------------------------------------------------------------- 3. budgets and 4. retries

def test_runs_of_other_budgets_are_not_comparable(tmp_path):
    path = spec(tmp_path, HEAD + """
variants:
  - {id: control, lr: 1.0e-3}
  - {id: lr-2, lr: 2.0e-3}
""")
    led = tmp_path / "l.db"
    run("campaign", "run", path, "--variant", "control", "--ledger", led, "--out", tmp_path / "runs")
    run("campaign", "run", path, "--variant", "lr-2", "--updates", "3", "--ledger", led, "--out", tmp_path / "runs")
    rows = {x["variant"]: x for x in report_rows(led)}
    assert rows["lr-2"]["comparable"] == "not comparable: 3 of 6 updates"
    said = run("campaign", "report", "--ledger", led).stdout
    assert "lr-2 is not comparable: 3 of 6 updates" in said and "lr-2 beats" not in said


def test_a_retry_keeps_the_earlier_divergence_visible(tmp_path):
    path = spec(tmp_path, DIVERGE)
    led = tmp_path / "l.db"
    run("campaign", "run", path, "--variant", "hot", "--ledger", led, "--out", tmp_path / "runs")
    run("campaign", "run", path, "--variant", "hot", "--lr", "1e-3", "--ledger", led, "--out", tmp_path / "runs")
    (row,) = report_rows(led)
    assert row["attempts"] == 2
    assert row["status"].startswith("finished on attempt 2; attempt 1 (lr 10) diverged at update ")
    said = run("campaign", "report", "--ledger", led).stdout
    assert "attempt 1 (lr 10) diverged at update" in said


# ---------------------------------------------------------------- 5. exit codes

def test_campaign_run_exits_1_when_a_run_errors(tmp_path):
    path = spec(tmp_path, HEAD.replace("builtin:gpt", "tests/workloads.py:raises").replace(
        "params: {layers: 1, d_model: 32, heads: 2, vocab: 64}", "params: {}") + """
variants:
  - {id: control, lr: 1.0e-3}
""")
    wl = tmp_path / "tests"
    wl.mkdir()
    (wl / "workloads.py").write_text("def raises(**kw):\n    raise RuntimeError('broken on purpose')\n")
    r = run("campaign", "run", path, "--ledger", tmp_path / "l.db", "--out", tmp_path / "runs", ok=False)
    assert r.exit_code == 1
    assert "1 run: 0 finished, 0 diverged, 1 error" in r.output and "Error: " in r.output


# ---------------------------------------------------------------- 6. paths from the spec's folder

def test_workload_paths_are_read_from_the_specs_folder(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "my_workload.py").write_text(textwrap.dedent("""
        from probes.builtin import GPT as gpt

        def small(**kw):
            return gpt(layers=1, d_model=32, heads=2, vocab=64)
    """))
    path = spec(proj, HEAD.replace("builtin:gpt", "my_workload.py:small").replace(
        "params: {layers: 1, d_model: 32, heads: 2, vocab: 64}", "params: {}") + """
variants:
  - {id: control, lr: 1.0e-3}
""")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run("campaign", "run", path, "--updates", "2", "--ledger", "l.db", "--out", "runs")
    (row,) = report_rows("l.db")
    assert row["status"] == "finished"


# ---------------------------------------------------------------- 7. data

def test_split_refuses_to_write_an_empty_split(tmp_path):
    import pandas as pd

    rows = [{"patient": p, "day": d, "x": 1} for p in range(4) for d in range(10)]
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    r = run("split", tmp_path / "d.csv", "--by", "patient", "--time", "day", "--gap", "7", "--out",
            tmp_path / "s", ok=False)
    assert r.exit_code == 1 and "Error: " in r.output and "would be empty" in r.output
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- 8. predictions

def test_predictions_are_kept_at_validation_points(tmp_path):
    path = spec(tmp_path, HEAD.replace("builtin:gpt", "builtin:classifier") + """
variants:
  - {id: control, lr: 1.0e-3}
""")
    led = tmp_path / "l.db"
    run("campaign", "run", path, "--ledger", led, "--out", tmp_path / "runs")
    preds = tables(led)["campaign_predictions"]
    assert sorted(set(preds["update_no"])) == [3, 6]
    assert len(preds[preds["update_no"] == 3]) == 16  # capped per point (16 examples evaluated)
    r = run("campaign", "report", "--ledger", led, "--predictions")
    assert "prediction" in r.stdout and "target" in r.stdout


# ---------------------------------------------------------------- 9. archive, determinism, resume-check

def test_archive_holds_source_spec_ledger_lines_and_the_workloads_revision(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "wl.py").write_text("from probes.builtin import GPT as gpt\n\ndef small(**kw):\n"
                                "    return gpt(layers=1, d_model=32, heads=2, vocab=64)\n")
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a", "-C", str(proj)]
    subprocess.run(["git", "init", "-q", str(proj)], check=True)
    subprocess.run(git + ["add", "wl.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "wl"], check=True)
    rev = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    path = spec(proj, HEAD.replace("builtin:gpt", "wl.py:small").replace(
        "params: {layers: 1, d_model: 32, heads: 2, vocab: 64}", "params: {}") + """
variants:
  - {id: control, lr: 1.0e-3}
""")
    led, out = tmp_path / "l.db", tmp_path / "runs"
    run("campaign", "run", path, "--updates", "2", "--ledger", led, "--out", out)
    run_id = tables(led)["campaign_runs"]["run_id"].iloc[0]
    run("archive", run_id, "--to", tmp_path / "a", "--ledger", led, "--out", out)
    a = tmp_path / "a"
    assert (a / "workload" / "wl.py").read_text() == (proj / "wl.py").read_text()
    assert (a / "spec" / "c.yaml").read_text() == path.read_text()
    lines = [json.loads(x) for x in (a / "ledger_lines.jsonl").read_text().splitlines()]
    assert {x["table"] for x in lines} >= {"campaign_runs", "campaign_events", "campaign_metrics"}
    assert all(x["run_id"] == run_id for x in lines)
    assert (a / "code_revision.txt").read_text().startswith(rev)  # the workload's folder, not the cwd's
    run("archive", "verify", a)


def test_code_revision_without_git_is_a_hash_of_the_source(tmp_path):
    from probes.campaign import code_revision

    (tmp_path / "wl.py").write_text("x = 1\n")
    rev = code_revision(tmp_path / "wl.py")
    assert rev.startswith("sha256:") and rev != "unknown"
    (tmp_path / "wl.py").write_text("x = 2\n")
    assert code_revision(tmp_path / "wl.py") != rev


def test_code_revision_in_a_repository_with_no_commits_says_so(tmp_path):
    """User (#44): `archive` of a workload in a folder after `git init`, before the first commit, said "no git
    repository" there: it says the repository has no commits yet."""
    from probes.campaign import code_revision

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "wl.py").write_text("x = 1\n")
    rev = code_revision(tmp_path / "wl.py")
    assert rev.startswith("sha256:") and "no git repository" not in rev
    assert f"no commits yet in the git repository at {tmp_path}" in rev


@pytest.fixture
def own_imports(monkeypatch):
    """What loading a workload in this process adds (its folder on sys.path, its modules) is undone afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("wl_", "rentplan_workload_")):
            del sys.modules[name]


def test_archive_carries_every_local_module_the_workload_imports(tmp_path, own_imports):
    """User (#44): a workload that imports a module beside it was archived without that module; code_revision.txt
    hashed only the workload file, and the archive's load snippet pointed at the original path."""
    proj = tmp_path / "proj"
    (proj / "wl_pkg").mkdir(parents=True)
    (proj / "wl_pkg" / "__init__.py").write_text("")
    (proj / "wl_pkg" / "sizes.py").write_text("SIZES = {'small': dict(layers=1, d_model=32, heads=2, vocab=64)}\n")
    (proj / "wl_blocks.py").write_text("from probes.builtin import GPT\nfrom wl_pkg.sizes import SIZES\n\n"
                                       "def small_gpt():\n    return GPT(**SIZES['small'])\n")
    (proj / "wl.py").write_text("import torch\nfrom wl_blocks import small_gpt\n\ndef small():\n"
                                "    return small_gpt()\n")
    (proj / "notes.py").write_text("raise SystemExit('not imported by the workload: never archived')\n")
    path = spec(proj, HEAD.replace("builtin:gpt", "wl.py:small").replace(
        "params: {layers: 1, d_model: 32, heads: 2, vocab: 64}", "params: {}") + """
variants:
  - {id: control, lr: 1.0e-3}
""")
    led, out, a = tmp_path / "l.db", tmp_path / "runs", tmp_path / "a"
    run("campaign", "run", path, "--updates", "2", "--ledger", led, "--out", out)
    run_id = tables(led)["campaign_runs"]["run_id"].iloc[0]
    run("archive", run_id, "--to", a, "--ledger", led, "--out", out)
    held = sorted(p.relative_to(a / "workload").as_posix() for p in (a / "workload").rglob("*.py"))
    assert held == ["wl.py", "wl_blocks.py", "wl_pkg/__init__.py", "wl_pkg/sizes.py"]
    assert (a / "workload" / "wl_pkg" / "sizes.py").read_text() == (proj / "wl_pkg" / "sizes.py").read_text()
    revision = (a / "code_revision.txt").read_text()
    assert revision.startswith("sha256:") and "4 files" in revision
    from probes.campaign import code_revision

    assert code_revision(proj / "wl.py") == revision.strip()
    (proj / "wl_pkg" / "sizes.py").write_text("SIZES = {'small': dict(layers=2, d_model=32, heads=2, vocab=64)}\n")
    assert code_revision(proj / "wl.py") != revision.strip()  # a revision over every module, not the file alone
    run("archive", "verify", a)
    # The README's snippet loads the archived copy from the archive's folder, with the original gone.
    readme = (a / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert str(proj) not in snippet and "workload/wl.py:small" in snippet
    proj.rename(tmp_path / "gone")
    from tests.conftest import ROOT

    r = subprocess.run([sys.executable, "-c", snippet + "\nprint(sum(p.numel() for p in model.parameters()))"],
                       cwd=a, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) > 0


HASH_SEEDED = '''
import torch
from probes.builtin import GPT as gpt

class HashSeeded:
    def __init__(self):
        self.inner = gpt(layers=1, d_model=32, heads=2, vocab=64)
        self.name = "hash-seeded"

    def build_model(self):
        return self.inner.build_model()

    def make_batch(self, split, index, micro_batch, seq_len):
        g = torch.Generator().manual_seed(hash((split, index)) % 2**31)
        ids = torch.randint(0, 64, (micro_batch, seq_len), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    def compute_loss(self, model, batch):
        return self.inner.compute_loss(model, batch)

def make():
    return HashSeeded()
'''


@pytest.mark.slow
def test_resume_check_catches_a_make_batch_seeded_from_hash(tmp_path):
    (tmp_path / "hs.py").write_text(HASH_SEEDED)
    r = run("resume-check", "-w", f"{tmp_path / 'hs.py'}:make", "--updates", "4", "--at", "2", ok=False)
    assert r.exit_code == 1 and "resume is not exact" in r.output
    assert "PYTHONHASHSEED" in r.output  # the resumed half ran under another hash seed, and says so


@pytest.mark.slow
def test_the_readme_workload_example_is_deterministic_across_processes(tmp_path):
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    code = readme.split("A complete workload file (`my_workload.py`)")[1].split("```python")[1].split("```")[0]
    (tmp_path / "my_workload.py").write_text(code)
    probe = ("import sys; sys.path.insert(0, %r); import my_workload; "
             "print(my_workload.regression().make_batch('train', 3, 2, 8)['x'].sum().item())" % str(tmp_path))
    outs = {subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1


# ---------------------------------------------------------------- 10. start-up

def test_start_up_is_reported_on_its_own_and_not_billed_to_the_first_variant(tmp_path):
    path = spec(tmp_path, HEAD + """
variants:
  - {id: control, lr: 1.0e-3}
""")
    led = tmp_path / "l.db"
    r = run("campaign", "run", path, "--ledger", led, "--out", tmp_path / "runs")
    assert "start-up: " in r.output and "not billed to any variant" in r.output
    m = tables(led)["campaign_metrics"]
    assert set(m["kind"]) == {"setup", "train", "val", "save", "export"}  # a checkpoint at each evaluation
    (row,) = report_rows(led)
    billed = m[m["kind"].isin(["train", "val", "save", "export"])]["seconds"].sum()
    assert row["hours"] == pytest.approx(billed / 3600)
    assert row["setup_s"] == pytest.approx(m[m["kind"] == "setup"]["seconds"].sum())


def test_a_variant_interrupted_and_resumed_is_billed_for_both_attempts(tmp_path):
    """Budget review: Ctrl-C at update 3, the rerun resumes from update 2's checkpoint and finishes. The report's
    hours and cost counted the finishing attempt alone (updates 2-4), as though the interrupted attempt's GPU time
    were free; every attempt a variant paid for is on its bill."""
    from tests.conftest import WORKLOADS

    path = spec(tmp_path, f"""
name: guide
workload: {WORKLOADS}:interrupt_once
params: {{layers: 1, d_model: 32, heads: 2, vocab: 64, marker: {tmp_path / "interrupted"}, at_index: 2}}
seq_len: 16
effective_batch: 2
micro_batch: 2
updates: 4
save_every_updates: 1
eval: {{every_updates: 2, examples: 2, seq_len: 16}}
precision: fp32
variants:
  - {{id: control, lr: 1.0e-3}}
""")
    led = tmp_path / "l.db"
    args = ("campaign", "run", path, "--ledger", led, "--out", tmp_path / "runs")
    assert run(*args, ok=False).exit_code == 130
    assert "resumed" in run(*args).output
    m = tables(led)["campaign_metrics"]
    billed = m[m["kind"].isin(["train", "val", "save", "export"])]
    assert billed["run_id"].nunique() == 2  # both attempts billed something
    (row,) = json.loads(run("campaign", "report", "--ledger", led, "--price", "2.5", "--format", "json").stdout)
    assert row["hours"] == pytest.approx(billed["seconds"].sum() / 3600)
    assert row["cost_usd"] == pytest.approx(billed["seconds"].sum() / 3600 * 2.5)


def test_spec_keys_that_nothing_reads_are_refused_by_name(tmp_path):
    from click.testing import CliRunner

    from planner.cli import cli
    from tests.factories import campaign_yaml

    spec = tmp_path / "c.yaml"
    spec.write_text(campaign_yaml(headroom=0.2, notes="try lr 3e-4 next", colour="blue"))
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(spec), "--ledger", str(tmp_path / "l.db")])
    assert r.exit_code == 1
    assert "headroom: headroom is an option of plan (--headroom 0.1)" in r.output
    assert "notes: notes are not read from a spec" in r.output
    assert "colour: unknown key" in r.output  # every problem at once


def test_code_revision_of_a_workload_named_through_dotdot_covers_its_modules(tmp_path):
    """A fresh-clone user (#44): the order's campaign names the workload `../denoise.py` (order-campaign.yaml sits in
    rentplan-out/), and a workload that imports a module beside it crashed campaign run on the rented machine
    ("'.../denoise.py' is not in the subpath of '.../rentplan-out/..'")."""
    from probes.campaign import code_revision

    (tmp_path / "out").mkdir()
    (tmp_path / "mylayers.py").write_text("X = 1\n")
    (tmp_path / "denoise.py").write_text("from mylayers import X\n")
    rev = code_revision(tmp_path / "out" / ".." / "denoise.py")
    assert "over 2 files: denoise.py, mylayers.py" in rev, rev
