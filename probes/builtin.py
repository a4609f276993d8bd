"""Built-in workloads: `gpt` (decoder-only causal LM) and `classifier` (sequence classifier).

No download, any size. Data is synthetic but learnable and deterministic in (split, index):
  gpt: prompt = random tokens, response = the prompt shifted by one id; prompt positions are masked
       out of the loss with -100, so the model is graded on the response only.
  classifier: variable-length padded sequences; the class is decided by which marker token dominates.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
PAD = 0


def _generator(split: str, index: int, salt: int = 0) -> torch.Generator:
    # Seeded from (split, index) only: the same batch comes back after a resume, whatever ran before.
    g = torch.Generator(device="cpu")
    g.manual_seed(zlib.crc32(f"{split}:{index}:{salt}".encode()))
    return g


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, ffn: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, ffn)
        self.down = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0  # GPT-2 style: attention and residual dropout
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p,
                                           is_causal=self.causal and attn_mask is None)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, d)), p, self.training)
        return x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), p, self.training)


class Transformer(nn.Module):
    """Token + position embeddings, `layers` blocks, a final norm and an output head."""

    def __init__(self, layers: int, d_model: int, heads: int, ffn: int, vocab: int, max_len: int,
                 n_out: int, causal: bool, dropout: float = 0.0):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.dropout = dropout
        self.blocks = nn.ModuleList(Block(d_model, heads, ffn, causal, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_out, bias=False)
        self.checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        """Same name as Hugging Face models: the harness calls it when checkpointing=on."""
        self.checkpointing = True

    def hidden(self, ids: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = F.dropout(self.tok(ids) + self.pos(pos), self.dropout, self.training)
        for block in self.blocks:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, attn_mask, use_reentrant=False)
            else:
                x = block(x, attn_mask)
        return self.ln(x)

    def forward(self, ids: torch.Tensor, attn_mask: torch.Tensor | None = None,
                pool_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token logits; with pool_mask (batch, seq), one row per sequence: the mean over its real tokens.
        Everything goes through forward, so DDP and FSDP wrappers see the whole computation."""
        h = self.hidden(ids, attn_mask)
        if pool_mask is not None:
            m = pool_mask.unsqueeze(-1).to(h.dtype)
            h = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return self.head(h)


@dataclass
class GPT:
    """Decoder-only causal LM; prompt tokens are masked out of the loss (-100)."""

    layers: int = 2
    d_model: int = 128
    heads: int = 4
    ffn: int | None = None
    vocab: int = 512
    max_len: int = 4096
    prompt_fraction: float = 0.5
    dropout: float = 0.0  # attention, residual and embedding dropout (GPT-2 uses 0.1)
    name: str = field(init=False, default="gpt")
    masks_prompt: bool = field(init=False, default=True)

    def __post_init__(self):
        self.ffn = self.ffn or 4 * self.d_model
        self.name = f"gpt-{self.layers}L-{self.d_model}d"

    def build_model(self) -> nn.Module:
        return Transformer(self.layers, self.d_model, self.heads, self.ffn, self.vocab, self.max_len,
                           n_out=self.vocab, causal=True, dropout=self.dropout)

    def make_batch(self, split: str, index: int, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
        if seq_len < 4:
            raise ValueError("gpt needs seq_len >= 4")
        g = _generator(split, index)
        n_prompt = max(1, int((seq_len + 1) * self.prompt_fraction))
        n_resp = seq_len + 1 - n_prompt
        prompt = torch.randint(1, self.vocab, (micro_batch, n_prompt), generator=g)
        reps = -(-n_resp // n_prompt)
        response = (prompt.repeat(1, reps)[:, :n_resp] % (self.vocab - 1)) + 1  # shifted copy: learnable
        seq = torch.cat([prompt, response], dim=1)
        ids, labels = seq[:, :-1].clone(), seq[:, 1:].clone()
        labels[:, : n_prompt - 1] = IGNORE  # the next token is still prompt: not graded
        return {"input_ids": ids, "labels": labels}

    def compute_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE)

    def count_targets(self, batch: dict) -> int:
        return int((batch["labels"] != IGNORE).sum())

    def predict(self, model: nn.Module, batch: dict):
        logits = model(batch["input_ids"])
        keep = batch["labels"] != IGNORE
        return logits.argmax(-1)[keep], batch["labels"][keep]

    def show(self, batch: dict) -> list[dict[str, str]]:
        out = []
        for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
            seen = [f"{i}->{t}" for i, t in zip(ids, labels) if t != IGNORE]
            out.append({
                "input": " ".join(map(str, ids)),
                "target": " ".join("·" if t == IGNORE else str(t) for t in labels),
                "mask": "".join("." if t == IGNORE else "x" for t in labels),
                "loss sees": " ".join(seen),
            })
        return out


@dataclass
class Classifier:
    """Sequence classifier with named classes over padded, variable-length token sequences."""

    layers: int = 2
    d_model: int = 128
    heads: int = 4
    ffn: int | None = None
    vocab: int = 512
    max_len: int = 4096
    classes: str = "negative,neutral,positive"
    dropout: float = 0.0
    name: str = field(init=False, default="classifier")

    def __post_init__(self):
        self.ffn = self.ffn or 4 * self.d_model
        self.class_names = [c.strip() for c in str(self.classes).split(",") if c.strip()]
        self.name = f"classifier-{self.layers}L-{self.d_model}d-{len(self.class_names)}c"

    def build_model(self) -> nn.Module:
        return Transformer(self.layers, self.d_model, self.heads, self.ffn, self.vocab, self.max_len,
                           n_out=len(self.class_names), causal=False, dropout=self.dropout)

    def make_batch(self, split: str, index: int, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
        g = _generator(split, index)
        n = len(self.class_names)
        labels = torch.randint(0, n, (micro_batch,), generator=g)
        lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (micro_batch,), generator=g)
        ids = torch.randint(n + 1, self.vocab, (micro_batch, seq_len), generator=g)
        marker = (labels + 1).unsqueeze(1).expand(-1, seq_len)
        ids = torch.where(torch.rand(micro_batch, seq_len, generator=g) < 0.3, marker, ids)  # class marker
        mask = torch.arange(seq_len).unsqueeze(0) < lengths.unsqueeze(1)
        ids = ids.masked_fill(~mask, PAD)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def _logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        mask = batch["attention_mask"]
        attn = mask[:, None, None, :]  # keys that are padding are not attended to
        return model(batch["input_ids"], attn, pool_mask=mask)  # mean over real tokens only

    def compute_loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self._logits(model, batch).float(), batch["labels"])

    def count_targets(self, batch: dict) -> int:
        return int(batch["labels"].numel())

    def predict(self, model: nn.Module, batch: dict):
        return self._logits(model, batch).argmax(-1), batch["labels"]

    def show(self, batch: dict) -> list[dict[str, str]]:
        out = []
        for ids, mask, label in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist(),
                                    batch["labels"].tolist()):
            n = sum(mask)
            out.append({
                "input": " ".join(map(str, ids[:n])) + (f" + {len(ids) - n} pad" if n < len(ids) else ""),
                "target": f"{label} ({self.class_names[label]})",
                "mask": "".join("x" if m else "." for m in mask),
                "loss sees": f"class {label} from the mean of {n} real tokens",
            })
        return out


BUILTINS = {"gpt": GPT, "classifier": Classifier}
