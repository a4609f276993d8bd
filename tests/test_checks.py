"""The shared loop's arithmetic and the pilot checks: inspect, overfit, split, resume-check."""

import json
import os

import pandas as pd
import pytest
from click.testing import CliRunner

from planner.cli import cli
from planner.records import ProbeConfig
from tests.conftest import TINY, WORKLOADS

torch = pytest.importorskip("torch")
from probes import checkpoint  # noqa: E402
from probes.checkpoint import safe_load  # noqa: E402
from probes.loop import ResumeError, Trainer  # noqa: E402
from probes.workloads import load_workload  # noqa: E402

TINY_ARGS = [x for k, v in TINY.items() for x in ("-p", f"{k}={v}")]


def trainer_for(ref, grad_accum=2, precision="fp32", **params):
    w = load_workload(ref, {**TINY, **params})
    cfg = ProbeConfig(workload=ref, params_json=json.dumps(TINY), micro_batch=2, seq_len=16, grad_accum=grad_accum,
                      precision=precision)
    torch.manual_seed(0)
    return w, Trainer(w, cfg, torch.device("cpu"))


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def full_batch_grads(w, t, indices):
    t.model.zero_grad(set_to_none=True)
    batches = [w.make_batch("train", i, 2, 16) for i in indices]
    full = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    w.compute_loss(t.model, full).backward()
    return grads(t.model)


def close(a, b):
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


def test_accumulation_normalises_by_counted_targets_not_by_k():
    w, t = trainer_for(f"{WORKLOADS}:variable_mask")
    counts = [w.count_targets(w.make_batch("train", i, 2, 16)) for i in (0, 1)]
    assert counts[0] != counts[1]  # the point of the test: unequal numbers of unmasked tokens
    t.begin_window([0, 1])
    t.micro_step()
    t.micro_step()
    accumulated = grads(t.model)
    reference = full_batch_grads(w, t, [0, 1])
    assert close(accumulated, reference)
    # the naive loop (each micro-batch's mean loss / K) gets a different gradient: this test would catch it
    t.model.zero_grad(set_to_none=True)
    for i in (0, 1):
        (w.compute_loss(t.model, w.make_batch("train", i, 2, 16)) / 2).backward()
    assert not close(grads(t.model), reference)


def test_seven_micro_batches_with_accumulation_four():
    w, t = trainer_for(f"{WORKLOADS}:variable_mask", grad_accum=4)
    counts = [w.count_targets(w.make_batch("train", i, 2, 16)) for i in range(7)]
    results = t.train_epoch(7)
    assert [r.micro_batches for r in results] == [4, 3] and t.update == 2
    assert results[1].targets == sum(counts[4:])  # the short window is normalised by its own count
    assert all(p.grad is None for p in t.model.parameters())  # nothing leaks past the epoch boundary


def test_short_window_gradient_equals_its_full_batch():
    w, t = trainer_for(f"{WORKLOADS}:variable_mask", grad_accum=4)
    t.begin_window([4, 5, 6])
    for _ in range(3):
        t.micro_step()
    assert close(grads(t.model), full_batch_grads(w, t, [4, 5, 6]))


def test_scaler_and_scheduler_steps_equal_optimizer_updates():
    w, t = trainer_for("builtin:gpt", grad_accum=4, precision="fp16")
    calls = {"step": 0, "update": 0, "unscale_": 0, "sched": 0}

    def counting(name, fn):
        def inner(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return inner

    for name in ("step", "update", "unscale_"):
        setattr(t.scaler, name, counting(name, getattr(t.scaler, name)))
    t.scheduler.step = counting("sched", t.scheduler.step)
    t.train_epoch(7)
    assert t.update == 2
    assert calls == {"step": 2, "update": 2, "unscale_": 2, "sched": 2}
    _, t16 = trainer_for("builtin:gpt", precision="bf16")
    assert t16.scaler is None  # bf16 runs without a scaler


def test_pickle_payload_refused_even_with_force_env(tmp_path, monkeypatch):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = str(tmp_path / "evil.pt")
    torch.save({"model": {}, "payload": Evil()}, path)
    for env in (None, "1"):
        if env:
            monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", env)
        with pytest.raises(ResumeError, match="posix.system"):
            safe_load(path)


@pytest.mark.parametrize("drop", ["rng", "scaler"])
def test_partial_checkpoint_fails_loudly(tmp_path, drop):
    w, t = trainer_for("builtin:gpt", precision="fp16", grad_accum=1)
    t.train_update()
    state = checkpoint.training_state(t)
    state.pop(drop) if drop == "rng" else state.update(scaler=None)
    path = str(tmp_path / "c.pt")
    torch.save(state, path)
    _, fresh = trainer_for("builtin:gpt", precision="fp16", grad_accum=1)
    with pytest.raises(ResumeError, match=drop):
        checkpoint.load(fresh, path)


def test_own_checkpoints_load_weights_only_without_allowlist(tmp_path):
    _, t = trainer_for("builtin:gpt", precision="fp16", grad_accum=2)
    t.train_update(stop_after=1)  # inside a window: partial gradients are saved too
    path = str(tmp_path / "c.pt")
    checkpoint.save(t, path)
    state = torch.load(path, weights_only=True)
    assert state["window"]["done"] == 1 and state["grads"] is not None


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.mark.parametrize("ref", ["builtin:gpt", "builtin:classifier"])
def test_overfit_passes_on_builtins(ref):
    r = run("overfit", "-w", ref, *TINY_ARGS, "--updates", "120")
    assert r.exit_code == 0, r.output
    assert "overfit passed" in r.output and "recovered" in r.output and "generalisation" in r.output


def test_overfit_fails_when_loss_ignores_the_model():
    r = CliRunner().invoke(cli, ["overfit", "-w", f"{WORKLOADS}:ignores_model", *TINY_ARGS, "--updates", "20"])
    assert r.exit_code == 1 and "overfit failed" in r.output and "not <= 10% of the first" in r.output


def test_inspect_shows_masked_prompt_of_gpt_and_warns_on_counted_padding():
    r = run("inspect", *TINY_ARGS, "-n", "1", "--seq-len", "12")
    assert r.exit_code == 0
    assert "mask: .....xxxxxxx" in r.output and "no masking problems found" in r.output
    r = CliRunner().invoke(cli, ["inspect", "-w", f"{WORKLOADS}:pads_and_counts_padding", *TINY_ARGS, "--strict"])
    assert r.exit_code == 1
    assert "padding counted in the loss" in r.output


def test_inspect_classifier_prints_class_names():
    r = run("inspect", "-w", "builtin:classifier", *TINY_ARGS, "-n", "2")
    assert r.exit_code == 0
    assert "classes: 0=negative, 1=neutral, 2=positive" in r.output
    assert "target:" in r.output and "mean of" in r.output


IMAGE_WORKLOADS = (
    '"""Image models as a user writes them: a denoiser (image in, image out) and a small image classifier."""\n'
    '''import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def _images(split, index, micro_batch, side):
    g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
    return g, torch.rand(micro_batch, 3, side, side, generator=g)


class Denoiser:
    name = "unet-denoiser-b"

    def build_model(self):
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))

    def make_batch(self, split, index, micro_batch, seq_len):
        g, clean = _images(split, index, micro_batch, seq_len)
        return {"noisy": clean + 0.1 * torch.randn(clean.shape, generator=g), "clean": clean}

    def compute_loss(self, model, batch):
        return F.mse_loss(model(batch["noisy"]), batch["clean"])


class ImageClassifier:
    name = "tiny-cnn"

    def build_model(self):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def make_batch(self, split, index, micro_batch, seq_len):
        g, x = _images(split, index, micro_batch, seq_len)
        return {"pixels": x, "labels": torch.randint(0, 10, (micro_batch,), generator=g)}

    def compute_loss(self, model, batch):
        return F.cross_entropy(model(batch["pixels"]), batch["labels"])


def denoiser():
    return Denoiser()


def image_classifier():
    return ImageClassifier()
''')


def test_inspect_knows_an_image_model_has_no_class_or_vocabulary_axis(tmp_path):
    """User (#44): `inspect` of an image model printed "model outputs: 32", the image width, as if it were a
    number of classes. inspect reads the model's task first: the width of the output is said only where it is a
    class or vocabulary axis."""
    (tmp_path / "images.py").write_text(IMAGE_WORKLOADS)
    r = CliRunner().invoke(cli, ["inspect", "-w", f"{tmp_path / 'images.py'}:denoiser", "--seq-len", "32", "-n", "2",
                                 "--strict"])
    assert r.exit_code == 0, r.output
    assert "model outputs: 32" not in r.output
    assert "task: image or other (no class or vocabulary axis); model output per example: 3×32×32" in r.output
    assert "prompt" not in r.output
    r = CliRunner().invoke(cli, ["inspect", "-w", f"{tmp_path / 'images.py'}:image_classifier", "--seq-len", "32",
                                 "-n", "2", "--strict"])
    assert r.exit_code == 0, r.output
    assert "task: classification; model outputs: 10 classes" in r.output
    r = run("inspect", *TINY_ARGS, "-n", "1", "--seq-len", "12")  # the built-in causal LM keeps its check
    assert "task: causal LM; model outputs: 64 (vocabulary)" in r.output


@pytest.mark.parametrize("ref, extra", [("builtin:gpt", []), ("builtin:classifier", []),
                                        ("builtin:gpt", ["--grad-accum", "4", "--at-micro", "2", "--precision",
                                                         "fp16"])])
@pytest.mark.slow
def test_resume_check_passes_on_builtins(ref, extra):
    r = run("resume-check", "-w", ref, *TINY_ARGS, *extra)
    assert r.exit_code == 0, r.output
    assert "resume is exact" in r.output


@pytest.mark.slow
def test_resume_check_names_data_position_for_a_counter_workload():
    r = CliRunner().invoke(cli, ["resume-check", "-w", f"{WORKLOADS}:own_counter", *TINY_ARGS])
    assert r.exit_code == 1
    assert "data position" in r.output and "not keep its own counter" in r.output


def patients(tmp_path):
    df = pd.DataFrame({"patient": ["p1", "p1", "p2", "p2", "p3", "p4", "p5", "p5", "p6", "p7"],
                       "day": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "value": range(10)})
    path = tmp_path / "data.csv"
    df.to_csv(path, index=False)
    return df, path


def test_split_check_names_the_leaking_patient(tmp_path):
    df, _ = patients(tmp_path)
    df.iloc[:5].to_csv(tmp_path / "train.csv", index=False)
    df.iloc[1:2].assign(value=99).pipe(lambda x: pd.concat([x, df.iloc[5:]])).to_csv(tmp_path / "val.csv", index=False)
    r = CliRunner().invoke(cli, ["split", "--check", str(tmp_path / "train.csv"), str(tmp_path / "val.csv"),
                                 "--by", "patient"])
    assert r.exit_code == 1
    assert "group 'p1' (patient) is in train, val" in r.output


def test_split_check_finds_exact_duplicates(tmp_path):
    df, _ = patients(tmp_path)
    df.iloc[:5].to_csv(tmp_path / "a.csv", index=False)
    df.iloc[4:].to_csv(tmp_path / "b.csv", index=False)
    r = CliRunner().invoke(cli, ["split", "--check", str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert r.exit_code == 1 and "1 identical row(s) in train & val" in r.output


def test_split_by_patient_leaves_no_overlap_and_reports_fractions(tmp_path):
    _, path = patients(tmp_path)
    out = tmp_path / "out"
    r = run("split", str(path), "--by", "patient", "--ratios", "0.6,0.2,0.2", "--out", str(out), "--format", "csv")
    assert r.exit_code == 0
    report = pd.read_csv(pd.io.common.StringIO(r.stdout))
    assert list(report["split"]) == ["train", "val", "test"] and report["rows"].sum() == 10
    parts = [pd.read_csv(out / f"{n}.csv") for n in ("train", "val", "test")]
    sets = [set(p["patient"]) for p in parts]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    r = run("split", "--check", *(str(out / f"{n}.csv") for n in ("train", "val", "test")), "--by", "patient")
    assert r.exit_code == 0


def test_time_split_respects_the_gap(tmp_path):
    df = pd.DataFrame({"t": range(100), "g": [i // 3 for i in range(100)], "x": range(100)})
    path = tmp_path / "d.csv"
    df.to_csv(path, index=False)
    out = tmp_path / "out"
    r = run("split", str(path), "--time", "t", "--gap", "5", "--by", "g", "--out", str(out))
    assert r.exit_code == 0
    tr, va, te = (pd.read_csv(out / f"{n}.csv") for n in ("train", "val", "test"))
    assert va["t"].min() > tr["t"].max() + 5
    assert te["t"].min() > va["t"].max() + 5
    assert not (set(tr["g"]) & set(va["g"])) and not (set(va["g"]) & set(te["g"]))
