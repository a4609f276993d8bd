"""The training steps of the public H100 rows (benchmarks/gpu-truth/, from sanketpurandare/mem-run-estimator's
exp_utils.py), as rentplan workloads: the same models built from their configs with random weights, the same
inputs and losses. Nothing is downloaded.

- causal-lm (Llama-3.2-1B, gemma-2b, gpt2-large) and seq2seq (T5-large): `AutoModelFor*.from_config`, random
  token ids and random labels of the same length, the model's own loss. The models' code is transformers' of the
  rows' date (4.46, pinned by `make bench-truth`). T5's has changed since: under transformers 5.25, even with 2024's
  eager attention re-created, T5-large's estimate read 1.2-1.8 % under these rows' active peaks; 4.46's reads 0.1-0.5 %.
- timm (vit_huge_patch14_clip_224, convnextv2_huge): `timm.create_model(name, pretrained=False)` (1000 classes),
  random images of side `seq_len`, cross-entropy; `memory_format=channels_last` states NHWC (the public ConvNet
  rows of benchmarks/conv_truth.py ran their mixed-precision runs so).
- clip (clip-vit-large-patch14-336): `CLIPModel` from its config, images of side `seq_len`, the text config's
  max_length of token ids, and torchmultimodal's contrastive loss with a learned temperature.

    rentplan estimate -w benchmarks/truth_workloads.py:truth -p kind=timm -p source=convnextv2_huge ...
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def _generator(split: str, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))


class ClipWithLoss(nn.Module):
    """CLIPModel and torchmultimodal's ContrastiveLossWithTemperature (a learned log-temperature, init log(1/0.07),
    cross-entropy both ways over the normalised embeddings)."""

    def __init__(self, config):
        super().__init__()
        from transformers import CLIPModel

        self.clip_model = CLIPModel(config)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, input_ids, attention_mask, pixel_values):
        out = self.clip_model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values)
        a, b = F.normalize(out.image_embeds, dim=-1), F.normalize(out.text_embeds, dim=-1)
        logits = a @ b.t() * self.logit_scale.clamp(0, math.log(100)).exp()
        labels = torch.arange(a.shape[0], device=a.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class Truth:
    def __init__(self, kind: str, source: str, classes: int = 1000, memory_format: str = "contiguous"):
        if kind not in ("causal-lm", "seq2seq", "timm", "clip"):
            raise ValueError(f"kind must be causal-lm, seq2seq, timm or clip, got {kind!r}")
        self.kind, self.source, self.classes = kind, source, int(classes)
        self.memory_format = memory_format  # the harness applies it (README, 'The workload contract')
        self.name = f"truth-{kind}-{source.rstrip('/').split('/')[-1]}"
        self.config = None
        if kind != "timm":
            from transformers import AutoConfig

            self.config = AutoConfig.from_pretrained(source)

    def build_model(self):
        if self.kind == "timm":
            import timm

            return timm.create_model(self.source, pretrained=False, num_classes=self.classes)
        if self.kind == "clip":
            return ClipWithLoss(self.config)
        from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

        cls = AutoModelForCausalLM if self.kind == "causal-lm" else AutoModelForSeq2SeqLM
        return cls.from_config(self.config)

    def make_batch(self, split: str, index: int, micro_batch: int, seq_len: int) -> dict:
        g = _generator(split, index)
        if self.kind == "timm":  # seq_len is the image's side
            return {"x": torch.randn(micro_batch, 3, seq_len, seq_len, generator=g),
                    "y": torch.randint(0, self.classes, (micro_batch,), generator=g)}
        if self.kind == "clip":  # the text config's max_length: 20 (transformers' PretrainedConfig default then)
            text, n = self.config.text_config, getattr(self.config.text_config, "max_length", 20)
            return {"pixel_values": torch.randn(micro_batch, 3, seq_len, seq_len, generator=g),
                    "input_ids": torch.randint(0, text.vocab_size, (micro_batch, n), generator=g),
                    "attention_mask": torch.ones(micro_batch, n, dtype=torch.long)}
        vocab = self.config.vocab_size
        return {"input_ids": torch.randint(0, vocab, (micro_batch, seq_len), generator=g),
                "labels": torch.randint(0, vocab, (micro_batch, seq_len), generator=g)}

    def compute_loss(self, model, batch) -> torch.Tensor:
        if self.kind == "timm":
            return F.cross_entropy(model(batch["x"]), batch["y"])
        if self.kind == "clip":
            return model(**batch)
        return model(**batch).loss


def truth(kind: str, source: str, classes: int = 1000, memory_format: str = "contiguous"):
    return Truth(kind, source, classes, memory_format)
