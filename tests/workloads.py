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
    """Kills (SIGKILL), hangs, raises or is interrupted when asked for a batch of `phase_split` (val = eval phase)."""
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
            elif how == "interrupt_in_exec":  # a Ctrl-C or SIGTERM landing in code made by exec(), as dataclasses,
                exec("raise KeyboardInterrupt")  # namedtuple and torch build it while they import
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


class TimmStyleViT:
    """A ViT written the way timm writes one: stochastic-depth rates read with .item() from a linspace, a
    truncated-normal init, and a branch on a parameter's value while building (timm's vit and convnext
    stopped `estimate` with DataDependentOutputException before models were built for real off the fake mode)."""

    def __init__(self, depth: int = 4, dim: int = 96, heads: int = 3, patch: int = 16, image: int = 64,
                 classes: int = 10, drop_path: float = 0.1):
        self.name = f"timm-style-vit-{depth}x{dim}"
        self.depth, self.dim, self.heads, self.patch, self.image = depth, dim, heads, patch, image
        self.classes, self.drop_path = classes, drop_path

    def build_model(self):
        import torch.nn as nn

        dim, heads, n = self.dim, self.heads, (self.image // self.patch) ** 2
        rates = [x.item() for x in torch.linspace(0, self.drop_path, self.depth)]  # data-dependent Python

        class DropPath(nn.Module):
            def __init__(self, p):
                super().__init__()
                self.p = p

            def forward(self, x):
                if not self.training or self.p == 0:
                    return x
                keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - self.p)
                return x * keep / (1 - self.p)

        class Block(nn.Module):
            def __init__(self, p):
                super().__init__()
                self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
                self.attn = nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
                self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                self.drop = DropPath(p)

            def forward(self, x):
                h = self.norm1(x)
                x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
                return x + self.drop(self.mlp(self.norm2(x)))

        class ViT(nn.Module):
            def __init__(self, patch, classes):
                super().__init__()
                self.embed = nn.Conv2d(3, dim, patch, patch)
                self.cls = nn.Parameter(torch.zeros(1, 1, dim))
                self.pos = nn.Parameter(torch.zeros(1, n + 1, dim))
                nn.init.trunc_normal_(self.pos, std=0.02)
                if float(self.cls.abs().sum()) == 0:  # a branch on a parameter's value during construction
                    nn.init.normal_(self.cls, std=1e-6)
                self.blocks = nn.ModuleList(Block(p) for p in rates)
                self.head = nn.Linear(dim, classes)

            def forward(self, x):
                x = self.embed(x).flatten(2).transpose(1, 2)
                x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
                for b in self.blocks:
                    x = b(x)
                return self.head(x[:, 0])

        return ViT(self.patch, self.classes)

    def make_batch(self, split, index, micro_batch, seq_len):
        import zlib

        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        return {"x": torch.randn(micro_batch, 3, self.image, self.image, generator=g),
                "y": torch.randint(0, self.classes, (micro_batch,), generator=g)}

    def compute_loss(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def timm_style_vit(**kw):
    return TimmStyleViT(**kw)


class HFFromConfig:
    """A Hugging Face model built from a config object (random weights, nothing downloaded)."""

    def __init__(self, kind: str, size: str = "tiny"):
        self.kind, self.name = kind, f"hf-{kind}-{size}"
        big = size == "1b"
        self.config = self._config(kind, big)

    @staticmethod
    def _config(kind, big):
        import transformers as tf

        if kind == "gpt2":  # GPT-2 keeps dropout 0.1 on attention, residuals and embeddings
            return tf.GPT2Config(n_layer=24 if big else 2, n_embd=2048 if big else 64, n_head=16 if big else 2,
                                 vocab_size=50257 if big else 256, n_positions=1024)
        if kind == "llama":
            return tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=172, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256)
        if kind == "t5":
            return tf.T5Config(num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32,
                               vocab_size=256, decoder_start_token_id=0)
        if kind == "vit":
            return tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                image_size=32, patch_size=8, num_labels=10)
        if kind == "convnext":  # its encoder reads drop-path rates with .tolist() while it is built
            return tf.ConvNextConfig(depths=[1, 1, 2, 1], hidden_sizes=[16, 32, 64, 128], drop_path_rate=0.1,
                                     image_size=32, num_labels=10)
        raise ValueError(kind)

    def build_model(self):
        import transformers as tf

        cls = {"gpt2": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM, "t5": tf.T5ForConditionalGeneration,
               "vit": tf.ViTForImageClassification, "convnext": tf.ConvNextForImageClassification}[self.kind]
        return cls(self.config)

    def make_batch(self, split, index, micro_batch, seq_len):
        import zlib

        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        if self.kind in ("vit", "convnext"):
            return {"pixel_values": torch.randn(micro_batch, 3, 32, 32, generator=g),
                    "labels": torch.randint(0, 10, (micro_batch,), generator=g)}
        vocab = self.config.vocab_size
        ids = torch.randint(1, vocab, (micro_batch, seq_len), generator=g)
        if self.kind == "t5":
            return {"input_ids": ids, "labels": torch.randint(1, vocab, (micro_batch, seq_len // 2), generator=g)}
        return {"input_ids": ids, "labels": ids.clone()}

    def compute_loss(self, model, batch):
        return model(**batch).loss

    def gradient_checkpointing_enable(self):  # the harness calls the model's own
        raise AssertionError


def hf_from_config(kind: str = "gpt2", size: str = "tiny"):
    return HFFromConfig(kind, size)


class LSTMModel(torch.nn.Module):
    def __init__(self, vocab: int, width: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.lstm = torch.nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


class LSTMLanguageModel:
    """A recurrent language model (nn.LSTM): the kernel CPU and cuDNN run keeps per-step gates and states that the
    fake kernels of a composite LSTM do not show."""

    def __init__(self, vocab: int = 512, width: int = 256, layers: int = 2):
        self.vocab, self.width, self.layers = vocab, width, layers
        self.name = f"lstm-{layers}x{width}"

    def build_model(self):
        return LSTMModel(self.vocab, self.width, self.layers)

    def make_batch(self, split, index, micro_batch, seq_len):
        import zlib

        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        ids = torch.randint(0, self.vocab, (micro_batch, seq_len + 1), generator=g)
        return {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}

    def compute_loss(self, model, batch):
        logits = model(batch["input_ids"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def lstm_lm(vocab: int = 512, width: int = 256, layers: int = 2):
    return LSTMLanguageModel(vocab, width, layers)


def hidden_scratch(scratch_mib: int = 8, **kw):
    """A gpt whose loss keeps a scratch buffer alive through backward only when its tensors are real: the way a
    kernel without a matching fake (meta) kernel allocates more than an estimate sees."""
    from torch._subclasses.fake_tensor import is_fake

    w = _Wrapped(**kw)
    inner = w.compute_loss

    def compute_loss(model, batch):
        loss = inner(model, batch)
        if is_fake(loss):
            return loss
        scratch = torch.zeros(scratch_mib * 2**20 // 4, requires_grad=True)
        return loss + 0 * scratch.sum()  # kept for backward: `scratch` lives until the update ends

    w.compute_loss = compute_loss
    return w


def meet(folder: str = "", others: int = 1, wait_s: float = 60.0, **kw):
    """Says whether its process met `others` others at work: building the model, it leaves started-PID in
    `folder` and waits (at most wait_s) until others have left theirs, then leaves met-PID. Estimates that run
    side by side all meet; run one at a time, the first waits out wait_s and meets nobody."""
    w = _Wrapped(**kw)
    build = w.build_model

    def build_model():
        open(os.path.join(folder, f"started-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if sum(n.startswith("started-") for n in os.listdir(folder)) > others:
                open(os.path.join(folder, f"met-{os.getpid()}"), "w").close()
                break
            time.sleep(0.05)
        return build()

    w.build_model = build_model
    return w


def fork_witness(log: str = "", **kw):
    """A gpt whose build_model appends '<pid> <in bad CUDA fork?>' to `log` (or $RENTPLAN_FORK_LOG): under torch's
    CUDA build, a process forked after its parent asked CUDA anything cannot use the GPU (torch/csrc/cuda/Module.cpp,
    poison_fork), and this is how a CPU machine sees it."""
    w = _Wrapped(**kw)
    build = w.build_model
    path = log or os.environ.get("RENTPLAN_FORK_LOG", "")

    def build_model():
        if path:
            with open(path, "a") as f:
                f.write(f"{os.getpid()} {torch.cuda._is_in_bad_fork()}\n")
        return build()

    w.build_model = build_model
    return w


def tf32_new_api(where: str = "matmul", **kw):
    """A gpt whose workload turns TF32 on with the fp32_precision API PyTorch's notes now point to (after which the
    legacy getters raise "mix of the legacy and new APIs")."""
    if where == "matmul":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    else:
        torch.backends.fp32_precision = "tf32"
    return _Wrapped(**kw)


def bitfit(**kw):
    """A gpt that trains only its biases (BitFit): every module with a bias owns a frozen weight beside it."""
    w = _Wrapped(**kw)
    build = w.build_model

    def build_model():
        model = build()
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("bias"))
        return model

    w.build_model = build_model
    return w


def interrupt_once(marker: str, at_index: int = 5, **kw):
    """A gpt whose training batch `at_index` raises KeyboardInterrupt (as Ctrl-C or a SIGTERM turned into one
    does) the first time only: the marker file says it happened."""
    w = _Wrapped(**kw)
    make = w.make_batch

    def make_batch(split, index, micro_batch, seq_len):
        if split == "train" and index == at_index and not os.path.exists(marker):
            open(marker, "w").close()
            raise KeyboardInterrupt
        return make(split, index, micro_batch, seq_len)

    w.make_batch = make_batch
    return w


class ResNet50Like:
    """ResNet-50 v1.5 (torchvision's and NVIDIA DeepLearningExamples' layout: bottlenecks of [3, 4, 6, 3], the stride
    on the 3×3 conv, batch norm and ReLU), written out so the tests need no torchvision; images of side seq_len,
    1000 classes, cross-entropy. `memory_format` is the workload contract's optional member; `blocks` > 0 puts that
    many bottlenecks in each stage (a small net for quick tests)."""

    def __init__(self, memory_format: str = "contiguous", classes: int = 1000, blocks: int = 0):
        self.name = "resnet50-like"
        self.memory_format, self.classes = memory_format, classes
        self.stages = (3, 4, 6, 3) if blocks <= 0 else (blocks,) * 4

    def build_model(self):
        import torch.nn as nn

        def bn_conv(cin, cout, k, stride=1):
            return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]

        class Bottleneck(nn.Module):
            def __init__(self, cin, width, stride):
                super().__init__()
                cout = width * 4
                self.body = nn.Sequential(*bn_conv(cin, width, 1), nn.ReLU(inplace=True),
                                          *bn_conv(width, width, 3, stride), nn.ReLU(inplace=True),
                                          *bn_conv(width, cout, 1))
                self.down = nn.Sequential(*bn_conv(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

            def forward(self, x):
                return (self.body(x) + (x if self.down is None else self.down(x))).relu_()

        layers, cin = [*bn_conv(3, 64, 7, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)], 64
        for width, blocks, stride in zip((64, 128, 256, 512), self.stages, (1, 2, 2, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, self.classes))

    def make_batch(self, split, index, micro_batch, seq_len):
        import zlib

        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        return {"x": torch.randn(micro_batch, 3, seq_len, seq_len, generator=g),
                "y": torch.randint(0, self.classes, (micro_batch,), generator=g)}

    def compute_loss(self, model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def resnet50_like(memory_format: str = "contiguous", classes: int = 1000, blocks: int = 0):
    return ResNet50Like(memory_format, classes, blocks)
