"""The sheet and the messages people read (issue 27), each from the user's steps: 'does not fit' states the fit
rule's own inequality and says how many more; a one-point fit says it is not validated; help names every workload
form; a misspelled function gets a 'did you mean'; `campaign report SPEC` works as `campaign run SPEC` does; a cap
below the model's weights ends with what to do."""

import re

import pytest
from click.testing import CliRunner

from planner.cli import cli
from tests.factories import campaign_yaml, config, pilot_lines, standard_ledger, write_ledger

GiB = 2**30


def plan(tmp_path, monkeypatch, ledger):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", ledger, "--out", "out"])
    assert r.exit_code == 0, r.output
    return (tmp_path / "out" / "order_sheet.md").read_text(), (tmp_path / "out" / "order_sheet.html").read_text()


def test_does_not_fit_states_an_inequality_that_holds_and_how_many_more(tmp_path, monkeypatch):
    lines = []
    for mb in (1, 2):  # 30 GiB at micro-batch 1: the 16 and 24 GB cards do not hold it
        cfg = config(micro_batch=mb, seq_len=256, eval_seq_len=256, eval_micro_batch=mb)
        lines += pilot_lines(cfg, int(30 * GiB / 1.15) + mb * 2**20)
    md, html = plan(tmp_path, monkeypatch, write_ledger(tmp_path / "l.db", lines))
    said = re.findall(r"need ([0-9.]+) GiB \+ ([0-9.]+) (GiB|MiB) context and workspaces = ([0-9.]+) GiB > "
                      r"([0-9.]+) GiB usable", md)
    assert len(said) == 8 and "more (selection.csv)" in md
    for need, ctx, unit, total, usable in said:
        assert float(total) > float(usable)  # the shown inequality is true
        assert float(need) + float(ctx) / (1 if unit == "GiB" else 1024) == pytest.approx(float(total), abs=0.02)
    assert 'id="show-all"' in html and "v-does-not-fit" in html  # every offer reachable in the page


def test_a_one_point_fit_says_it_is_not_validated(tmp_path, monkeypatch):
    cfg = config(micro_batch=2, seq_len=256, eval_seq_len=256, eval_micro_batch=2)
    md, _ = plan(tmp_path, monkeypatch, write_ledger(tmp_path / "l.db", pilot_lines(cfg, 200 * 2**20)))
    assert "from one point (a line through its baseline): not validated" in md
    assert "max error on them 0.00%" not in md


def test_help_names_every_workload_form_and_the_archive_folder():
    probe = CliRunner().invoke(cli, ["probe", "--help"]).output
    assert "script:NAME" in probe and "hf:CONFIG_DIR" in probe
    assert "the folder `campaign run --out` wrote the runs to" in CliRunner().invoke(cli, ["archive", "--help"]).output


def test_a_misspelled_workload_function_gets_did_you_mean(tmp_path):
    (tmp_path / "wl.py").write_text("def regression(width=8):\n    pass\n")
    r = CliRunner().invoke(cli, ["inspect", "-w", f"{tmp_path / 'wl.py'}:regresion"])
    assert r.exit_code == 1 and "Did you mean 'regression'?" in r.output


def test_campaign_report_takes_the_spec_as_campaign_run_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(campaign_yaml())
    led = standard_ledger(tmp_path / "l.db")
    r = CliRunner().invoke(cli, ["campaign", "report", "c.yaml", "--ledger", led])
    assert "Usage" not in r.output and "No such" not in r.output and "Traceback" not in r.output, r.output
    r = CliRunner().invoke(cli, ["campaign", "report", "c.yaml", "--campaign", "other", "--ledger", led])
    assert r.exit_code == 1 and "c.yaml is campaign 'test-campaign', --campaign says 'other'" in r.output


@pytest.mark.slow
def test_a_cap_below_the_weights_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = ["-p", "layers=2", "-p", "d_model=256", "-p", "heads=4", "-p", "vocab=4096", "--seq-len", "64"]
    r = CliRunner().invoke(cli, ["probe", "--cap", "2MiB", "--micro-batch", "1", "--ledger", "l.db", *model])
    assert (r.exit_code == 1 and "the cap is below the model's own weights" in r.output
            and "rentplan estimate" in r.output)
    r = CliRunner().invoke(cli, ["probe", "--find", "max-micro-batch", "--cap", "2MiB", "--ledger", "f.db", *model])
    assert r.exit_code == 1 and "(micro-batch 1 ended oom)" in r.output and "(1, 'oom')" not in r.output


@pytest.mark.slow  # a plan per hostile name
def test_names_cannot_break_the_markdown_sheet(tmp_path, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load(campaign_yaml())
    spec["variants"][0]["id"] = "<b>v</b>|x"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    r = CliRunner().invoke(cli, ["plan", "--campaign", "c.yaml", "--ledger", standard_ledger(tmp_path / "l.db"),
                                 "--out", "out"])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "out" / "order_sheet.md").read_text()
    assert "<b>" not in md and "&lt;b>v&lt;/b>\\|x" in md
    plans = md.split("## Plans")[1].split("\n\n")[1]
    rows = [line for line in plans.splitlines() if line.startswith("|") and not line.startswith("|---")]
    assert {line.count(" | ") for line in rows} == {8}  # no extra column


# ---------------------------------------------------------------- a helper's findings, round 2 (issue 27)

def test_a_two_point_line_says_it_is_exact_by_construction_not_validated(tmp_path, monkeypatch):
    """A line through two points has no error on them whatever the truth: '0.00 %' read as validated."""
    lines = []
    for mb in (1, 2):
        cfg = config(micro_batch=mb, seq_len=256, eval_seq_len=256, eval_micro_batch=mb)
        lines += pilot_lines(cfg, 200 * 2**20 + mb * 2**20)
    md, _ = plan(tmp_path, monkeypatch, write_ledger(tmp_path / "l.db", lines))
    assert "through 2 point(s), exact by construction: not validated" in md
    assert "max error on them 0.00%" not in md and "fit3" not in md


@pytest.mark.slow
def test_estimate_under_a_cap_below_the_weights_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["estimate", "-p", "layers=2", "-p", "d_model=256", "-p", "heads=4", "-p",
                                 "vocab=4096", "--seq-len", "64", "--micro-batch", "1", "--cap", "2MiB",
                                 "--target", "sm80+", "--ledger", "l.db"])
    assert r.exit_code == 1 and "the cap is below the model's own weights" in r.output
    assert "drop --cap" in r.output


@pytest.mark.slow
def test_a_parameter_that_breaks_every_configuration_ends_with_an_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["probe", "-w", "builtin:gpt", "-p", "d_model=abc", "--micro-batch", "1",
                                 "--seq-len", "8", "--ledger", "l.db"])
    assert r.exit_code == 1 and "every configuration failed before it measured anything" in r.output, r.output
    assert "rentplan inspect -w builtin:gpt" in r.output


@pytest.mark.parametrize("args, says", [
    (["probe", "-w", "script:train"], "run it with --script FILE"),
    (["probe", "-w", "builtin:gtp"], "did you mean builtin:gpt?"),
    (["verify", "nowhere/order.json"], "Make one with `rentplan plan --out DIR`"),
    (["campaign", "report", "--campaign", "x", "--ledger", "none.db"], "`rentplan campaign run SPEC`"),
    (["archive", "verify", "."], "Make one with `rentplan archive RUN --to"),
])
def test_errors_name_the_next_command(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1 and says in r.output, r.output
    assert not (tmp_path / "none.db").exists()


def test_estimate_help_offers_no_script_workload():
    assert "script:NAME" not in CliRunner().invoke(cli, ["estimate", "--help"]).output


def test_a_note_on_a_run_the_ledger_does_not_hold_is_refused(tmp_path):
    led = standard_ledger(tmp_path / "l.db")
    r = CliRunner().invoke(cli, ["note", "typo run", "--run", "c-nope", "--ledger", led])
    assert r.exit_code == 1 and "no run c-nope" in r.output
    r = CliRunner().invoke(cli, ["note", "x", "--ledger", str(tmp_path / "new.db")])
    assert r.exit_code == 1 and not (tmp_path / "new.db").exists()
