"""Workloads that misbehave on purpose, for the failure-mode tests. Each wraps the built-in gpt."""

import os
import signal
import time

import torch

from probes.builtin import GPT


class _Wrapped(GPT):
    pass


def nan_at(update: int = 3, grad_accum: int = 1, **kw):
    """compute_loss returns NaN for every micro-batch of optimizer update `update` (1-based)."""
    w = _Wrapped(**kw)
    inner = w.compute_loss
    first_bad = (update - 1) * grad_accum

    def compute_loss(model, batch):
        loss = inner(model, batch)
        if int(batch["index"][0]) >= first_bad:
            return loss * float("nan")
        return loss

    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        b = make(split, index, micro_batch, seq_len)
        b["index"] = torch.full((micro_batch,), index)
        return b

    w.compute_loss, w.make_batch = compute_loss, make_batch
    return w


def die_in(phase_split: str = "val", how: str = "sigkill", **kw):
    """Kills (SIGKILL) or hangs its own process when asked for a batch of `phase_split` (val = eval phase)."""
    w = _Wrapped(**kw)
    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        if split == phase_split:
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif how == "hang":
                time.sleep(3600)
            elif how == "raise":
                raise RuntimeError("boom: simulated illegal memory access")
        return make(split, index, micro_batch, seq_len)

    w.make_batch = make_batch
    return w


def counts_padding(**kw):
    """A gpt whose labels never mask anything (prompt and padding counted): inspect must warn."""
    w = _Wrapped(**kw)
    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        b = make(split, index, micro_batch, seq_len)
        b["labels"] = b["input_ids"].roll(-1, dims=1)
        return b

    w.make_batch = make_batch
    return w


def not_a_workload():
    return object()


def raises(**kw):
    raise ValueError("bad parameter combination")


def pads_and_counts_padding(**kw):
    """A gpt with right padding and an attention mask whose labels still count the padded positions."""
    w = _Wrapped(**kw)
    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        b = make(split, index, micro_batch, seq_len)
        mask = torch.ones_like(b["input_ids"], dtype=torch.bool)
        mask[:, -4:] = False
        b["input_ids"] = b["input_ids"].masked_fill(~mask, 0)
        b["labels"] = b["input_ids"].roll(-1, dims=1)  # the bug: padding gets labels too
        b["attention_mask"] = mask
        return b

    w.make_batch = make_batch
    return w


def ignores_model(**kw):
    """compute_loss does not depend on the model's output: overfit must fail."""
    w = _Wrapped(**kw)

    def compute_loss(model, batch):
        logits = torch.zeros(batch["labels"].numel(), w.vocab)
        anchor = sum(p.sum() for p in model.parameters()) * 0.0  # keeps backward() working
        return torch.nn.functional.cross_entropy(logits, batch["labels"].flatten().clamp(min=0)) + anchor

    w.compute_loss = compute_loss
    return w


class _Counter(GPT):
    calls = 0

    def make_batch(self, split, index, micro_batch, seq_len):
        _Counter.calls += 1  # the bug: its own counter instead of `index`
        return super().make_batch(split, _Counter.calls, micro_batch, seq_len)


def own_counter(**kw):
    return _Counter(**kw)


def variable_mask(**kw):
    """Micro-batches with different numbers of counted targets (for the normalisation tests)."""
    w = _Wrapped(**kw)
    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        b = make(split, index, micro_batch, seq_len)
        keep = 1 + (index * 3) % (seq_len // 2)  # only the last `keep` positions count
        b["labels"][:, : seq_len - keep] = -100
        return b

    w.make_batch = make_batch
    return w


def rank_fails(rank: int = 1, how: str = "raise", **kw):
    """One rank raises (or hangs) in its first update; the other ranks are fine."""
    w = _Wrapped(**kw)
    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        if int(os.environ.get("RANK", "0")) == rank and split == "train":
            if how == "raise":
                raise RuntimeError(f"rank {rank} fails on purpose")
            time.sleep(3600)
        return make(split, index, micro_batch, seq_len)

    w.make_batch = make_batch
    return w


class ConvAudio:
    """A 1-D conv audio classifier (raw samples in, one of 8 classes out) with optional checkpointed blocks:
    the shape of model where counting FLOPs beside the memory tracker once kept recomputed tensors alive."""

    def __init__(self, channels: int = 32, blocks: int = 6, classes: int = 8):
        self.name = f"conv-audio-{channels}c-{blocks}b"
        self.channels, self.blocks, self.classes = channels, blocks, classes

    def build_model(self):
        import torch.nn as nn
        from torch.utils.checkpoint import checkpoint

        c, n_blocks, n_out = self.channels, self.blocks, self.classes

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.inp = nn.Conv1d(1, c, 9, padding=4)
                self.blocks = nn.ModuleList(nn.Sequential(nn.Conv1d(c, c, 9, padding=4), nn.GELU(),
                                                          nn.Conv1d(c, c, 9, padding=4)) for _ in range(n_blocks))
                self.out = nn.Linear(c, n_out)
                self.ckpt = False

            def gradient_checkpointing_enable(self):
                self.ckpt = True

            def forward(self, x):
                x = self.inp(x)
                for b in self.blocks:
                    x = x + (checkpoint(b, x, use_reentrant=False) if self.ckpt and self.training else b(x))
                return self.out(x.mean(-1))

        return Net()

    def make_batch(self, split, index, micro_batch, seq_len):
        import zlib

        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        return {"x": torch.randn(micro_batch, 1, seq_len, generator=g),
                "y": torch.randint(0, self.classes, (micro_batch,), generator=g)}

    def compute_loss(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def conv_audio(channels: int = 32, blocks: int = 6, classes: int = 8):
    return ConvAudio(channels, blocks, classes)
