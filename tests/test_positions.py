"""Max sequence never past the model's position limit (issue 27): the limit is read from the workload, the
model's config or its learned position table, recorded on the setup line, and the sheet says which bound it."""

from types import SimpleNamespace

import pandas as pd
import torch.nn as nn
from click.testing import CliRunner

from planner.cli import cli
from probes.positions import position_limit
from tests.factories import campaign_yaml


def rentplan(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


PARAMS = {"layers": 1, "d_model": 32, "heads": 2, "vocab": 64, "max_len": 32}  # a model with 32 learned positions


def estimate_and_plan(tmp_path, monkeypatch, micro_batches: str, campaign_seq: int) -> pd.DataFrame:
    """The user's steps: estimate the model, write a campaign at campaign_seq tokens, plan; the selection."""
    monkeypatch.chdir(tmp_path)
    w = ["-w", "builtin:gpt", *[x for k, v in PARAMS.items() for x in ("-p", f"{k}={v}")]]
    rentplan("estimate", *w, "--micro-batch", micro_batches, "--seq-len", "16", "--eval-seq-len", "16", "--target",
             "sm80+", "--ledger", "l.db")
    (tmp_path / "c.yaml").write_text(campaign_yaml(params=PARAMS, seq_len=campaign_seq, eval={
        "every_updates": 50, "examples": 8, "seq_len": campaign_seq}))
    rentplan("plan", "--campaign", "c.yaml", "--ledger", "l.db", "--out", "out")
    return pd.read_csv(tmp_path / "out" / "selection.csv")


def test_a_model_with_32_positions_gets_a_max_sequence_of_32_and_says_why(tmp_path, monkeypatch):
    """The sheet's max sequence is 32 (the model's position table), not '≥ 1,048,576 (search limit)'."""
    sheet = estimate_and_plan(tmp_path, monkeypatch, "1,2", 16)
    sized = sheet[sheet["max_seq_len_at_mb1"].notna()]
    assert len(sized) and (sized["max_seq_len_at_mb1"] == 32).all()
    assert sized["max_seq_len_bound"].str.contains("position table pos, 32 rows", regex=False).all()
    md = (tmp_path / "out" / "order_sheet.md").read_text()
    assert "1,048,576" not in md and "32 (the model's position limit (position table pos, 32 rows))" in md


def test_a_campaign_longer_than_the_model_takes_is_said_on_every_row(tmp_path, monkeypatch):
    """Said, not refused: a position table found by its shape may belong to another input (the public CLIP row's
    text tower has 77 positions while its seq_len, 336, is the image side; a refusal stopped that real run)."""
    notes = estimate_and_plan(tmp_path, monkeypatch, "1", 64)["notes"].fillna("")
    assert notes.str.contains("sequence length 64 is past the model's position limit 32", regex=False).all()


def test_the_limit_is_read_from_the_workload_then_the_config_then_a_position_table():
    class WithTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.wpe = nn.Embedding(100, 8), nn.Embedding(77, 8)

    table = WithTable()
    assert position_limit(None, table) == (77, "position table wpe, 77 rows")
    table.config = SimpleNamespace(n_positions=1024)
    assert position_limit(None, table) == (1024, "config.n_positions")
    assert position_limit({"max_seq_len": 512}, table) == (512, "workload.max_seq_len")
    assert position_limit(SimpleNamespace(max_seq_len=True), nn.Linear(2, 2)) == (None, "")  # a bool is no length
    assert position_limit(None, nn.Sequential(nn.Embedding(10, 2))) == (None, "")  # a token table is no limit


def test_find_max_seq_len_stops_at_the_model_position_limit(tmp_path, monkeypatch):
    """`probe --find max-seq-len` on a 32-position model: the estimate (fake tensors index past the table
    unchecked) must not send the real probes past 32; the answer says the position limit bound it."""
    monkeypatch.chdir(tmp_path)
    r = rentplan("probe", "-w", "builtin:gpt", "-p", "layers=1", "-p", "d_model=32", "-p", "heads=2", "-p", "vocab=64",
                 "-p", "max_len=32", "--micro-batch", "1", "--seq-len", "16", "--cap", "1GiB", "--find",
                 "max-seq-len", "--ledger", "l.db")
    assert "largest seq_len that ran under cap 1GiB: 32 (the model's position limit (position table pos, 32 rows)" \
        in r.output
