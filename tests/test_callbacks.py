"""The user's own loop, seen by a callback: a Hugging Face Trainer and a Lightning Trainer on CPU write ledger
lines per phase that `plan` uses like a probe's; an OOM under a cap becomes an `oom` line and is raised again."""

import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.decisions.evidence import run_facts
from planner.ledger import read_lines

torch = pytest.importorskip("torch")

SPEC = """name: tiny-trainer
workload: {workload}
precision: fp32
optimizer: {optimizer}
seq_len: 32
effective_batch: 8
updates: 1000
eval: {{every_updates: 100, examples: 64, seq_len: 48}}
export: model
setup_hours: 0.5
variants:
  - {{id: control, lr: 1.0e-3, priority: 1}}
"""


def token_rows(n, length, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": (ids := torch.randint(0, 256, (length,), generator=g).tolist()), "labels": ids}
            for _ in range(n)]


def hf_train(tmp_path, monkeypatch, evaluate=True, export=True, **callback):
    """A tiny GPT-2 under transformers.Trainer: 6 updates of 2 micro-batches, eval and save at update 3."""
    transformers = pytest.importorskip("transformers")
    from probes.callbacks import HFTrainerCallback

    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                                                 n_positions=128))
    args = transformers.TrainingArguments(
        output_dir="out", max_steps=6, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        gradient_accumulation_steps=2, eval_strategy="steps" if evaluate else "no", eval_steps=3,
        save_strategy="steps", save_steps=3, logging_steps=3, report_to=[], use_cpu=True, learning_rate=1e-3,
        disable_tqdm=True)
    cb = HFTrainerCallback(str(tmp_path / "l.db"), workload="trainer:tiny-gpt2", steady_updates=3, **callback)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_rows(64, 32, 1),
                                   eval_dataset=token_rows(8, 48, 2), callbacks=[cb])
    trainer.train()
    if export:
        with cb.export("export"):
            trainer.save_model("export")
    return read_lines(tmp_path / "l.db"), model


def plan_ok(tmp_path, workload, optimizer="adamw"):
    spec = tmp_path / "c.yaml"
    spec.write_text(SPEC.format(workload=workload, optimizer=optimizer))
    r = CliRunner().invoke(cli, ["plan", "--campaign", str(spec), "--ledger", str(tmp_path / "l.db"),
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{"):])


def no_mode_left():
    return torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.slow
def test_hf_trainer_run_gives_phase_lines_that_plan_uses(tmp_path, monkeypatch):
    lines, model = hf_train(tmp_path, monkeypatch)
    assert no_mode_left(), "the tracker's mode must be gone once training ended"
    by = lines.set_index("phase")
    assert list(lines["phase"]) == ["setup", "first_step", "eval", "save", "steady", "export"]
    assert (lines["verdict"] == "ok").all() and set(lines["source"]) == {"hf-trainer"}
    assert lines["run_id"].nunique() == 1
    # The configuration read from the trainer and from what the model was called with.
    first = by.loc["first_step"]
    # The optimizer is named from the object the trainer built: transformers 5 defaults to torch's fused AdamW.
    assert (first["micro_batch"], first["seq_len"], first["grad_accum"], first["precision"], first["optimizer"]) == (
        4, 32, 2, "fp32", "adamw_fused")
    assert by.loc["eval", "eval_seq_len"] == 48  # the longest eval example
    # AdamW keeps two fp32 moments per trainable parameter (and a step scalar per tensor).
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 8 * params <= first["optimizer_state_bytes"] <= 8 * params + 8 * 64
    assert len(json.loads(by.loc["steady", "update_times_s"])) == 3
    assert by.loc["steady", "flops_per_update"] > 0 and "op census" in by.loc["steady", "detail"]
    assert by.loc["save", "checkpoint_bytes"] > by.loc["export", "checkpoint_bytes"] > 0  # state vs weights
    # Loss as the trainer reports it (the window's mean, not one micro-batch's share): near ln(256) at the start.
    assert 4.5 < first["loss_first"] < 6.5 and by.loc["eval", "loss_last"] > 0
    facts = run_facts(lines)
    assert bool(facts["complete"].iloc[0]), "setup, first_step, steady and eval make a callback run complete"
    out = plan_ok(tmp_path, "trainer:tiny-gpt2", "adamw_fused")
    assert out["selection"] and out["order"]["plan"]["run_ids"] == lines["run_id"].iloc[0]


@pytest.mark.slow
def test_hf_trainer_oom_under_a_cap_is_an_oom_line_and_raised_again(tmp_path, monkeypatch):
    with pytest.raises(torch.OutOfMemoryError):
        hf_train(tmp_path, monkeypatch, cap_bytes=3_000_000)
    assert no_mode_left()
    lines = read_lines(tmp_path / "l.db")
    assert list(lines["phase"]) == ["setup", "first_step"]
    assert list(lines["verdict"]) == ["ok", "oom"]
    oom = lines.iloc[1]
    assert oom["peak_allocated_bytes"] > 3_000_000 and "cap" in oom["detail"]
    assert not bool(run_facts(lines)["complete"].iloc[0])


@pytest.mark.slow
def test_census_update_leaves_the_steady_measurement_unchanged(tmp_path, monkeypatch):
    """The op census rides on an update of its own: the steady line's peaks are those of a run without it."""
    with_census, _ = hf_train(tmp_path / "a", monkeypatch, evaluate=False, export=False)
    without, _ = hf_train(tmp_path / "b", monkeypatch, evaluate=False, export=False, census=False)
    a, b = (df.set_index("phase").loc["steady"] for df in (with_census, without))
    assert a["peak_allocated_bytes"] == b["peak_allocated_bytes"]
    assert a["simulated_reserved_bytes"] == b["simulated_reserved_bytes"]
    assert a["flops_per_update"] > 0 and pd.isna(b["flops_per_update"])  # no census without it
    # A loop that never evaluates is not complete: its longest sequences were never measured.
    assert not bool(run_facts(with_census)["complete"].iloc[0])


@pytest.mark.slow
def test_lightning_run_gives_phase_lines_that_plan_uses(tmp_path, monkeypatch):
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from probes.callbacks import LightningCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 64)
            self.block = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
            self.head = torch.nn.Linear(64, 256)

        def forward(self, ids):
            return self.head(self.block(self.emb(ids)))

        def loss(self, batch):
            (ids,) = batch
            logits = self(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))

        def training_step(self, batch, i):
            return self.loss(batch)

        def validation_step(self, batch, i):
            self.log("val_loss", self.loss(batch))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    cb = LightningCallback(str(tmp_path / "l.db"), workload="lightning:tiny", steady_updates=3)
    trainer = L.Trainer(max_steps=6, accumulate_grad_batches=2, val_check_interval=6, limit_val_batches=2,
                        accelerator="cpu", callbacks=[cb], enable_progress_bar=False, logger=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path / "lout"), num_sanity_val_steps=1)
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randint(0, 256, (64, 33))), batch_size=4),
                DataLoader(TensorDataset(torch.randint(0, 256, (8, 49))), batch_size=4))
    assert no_mode_left()
    lines = read_lines(tmp_path / "l.db")
    by = lines.set_index("phase")
    assert set(lines["phase"]) == {"setup", "first_step", "steady", "eval", "save"}
    assert (lines["verdict"] == "ok").all() and set(lines["source"]) == {"lightning"}
    assert (by.loc["first_step", "micro_batch"], by.loc["first_step", "seq_len"], by.loc["first_step", "grad_accum"]) \
        == (4, 32, 2)
    # The validation batches were longer than training's: the eval line is sized at what eval ran, and says so.
    assert by.loc["eval", "eval_seq_len"] == 48 and "eval ran micro-batch 4 × seq 48" in by.loc["eval", "detail"]
    assert 4.5 < by.loc["first_step", "loss_first"] < 6.5
    assert os.path.getsize(next((tmp_path / "lout").rglob("*.ckpt"))) == by.loc["save", "checkpoint_bytes"]
    out = plan_ok(tmp_path, "lightning:tiny")
    assert out["selection"]
