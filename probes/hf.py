"""Hugging Face workloads: `--workload hf:PATH`, where PATH holds a config.json (architecture only).

Random weights unless `weights=true` and local safetensors are there; nothing is downloaded. Optional LoRA
through peft (`lora=r=16,alpha=32,targets=q_proj+v_proj`): only the adapter trains, so gradients and
optimizer state shrink to it, and export writes the adapter alone. Optional own data:
`data=FILE.jsonl fields=prompt,response` (or `text`, or `text,label`) tokenized with the tokenizer found
next to the config; prompt tokens are masked out of the loss. Without a tokenizer: random ids, said so.
"""

from __future__ import annotations

import json
import math
import re
import sys
import zlib
from pathlib import Path

import torch

from planner.errors import WorkloadError
from planner.inputs.grid import ON
from probes.loop import remake_real_tensors

IGNORE = -100


def parse_lora(text: str | dict | None) -> dict | None:
    """'r=16,alpha=32,targets=q_proj+v_proj' (targets also ';'- or ':'-separated) -> peft LoraConfig kwargs."""
    if not text:
        return None
    if isinstance(text, dict):
        raw = text
    else:
        raw = dict(part.split("=", 1) for part in str(text).split(",") if "=" in part)
    targets = str(raw.get("targets", "q_proj+v_proj")).replace(";", "+").replace(":", "+").split("+")
    return {"r": int(raw.get("r", 16)), "lora_alpha": int(raw.get("alpha", 2 * int(raw.get("r", 16)))),
            "target_modules": [t for t in targets if t], "lora_dropout": float(raw.get("dropout", 0.0))}


TRUNCATE = ("warn", "drop", "error")
SPLIT_NAMES = ("train", "val")


def _data_files(data: str | None, val_data: str | None) -> tuple[Path | None, Path | None]:
    """(train file, val file): data may be a folder written by `rentplan split` (train.jsonl, val.jsonl)."""
    if data and Path(data).is_dir():
        found = {n: Path(data) / f"{n}.jsonl" for n in SPLIT_NAMES}
        missing = [str(p) for p in found.values() if not p.is_file()]
        if missing:
            raise WorkloadError(f"data folder {data} lacks {', '.join(missing)} (write it with "
                                f"`rentplan split FILE.jsonl --by GROUP --out {data}`).")
        if val_data:
            raise WorkloadError("give val_data or a split folder as data, not both.")
        return found["train"], found["val"]
    if val_data and not data:
        raise WorkloadError("val_data needs data (the training file) too.")
    return (Path(data) if data else None), (Path(val_data) if val_data else None)


def _quant_options(quantize, bnb, head, double_quant, quant_from):
    """QLoRA's loader, as the run will have it (probes/quantize.py QuantOptions): bnb=VERSION (estimates trace
    that version's MatMul4Bit), quant_head, double_quant, quant_from (float16 for Lightning/litgpt)."""
    from probes.quantize import QuantOptions, installed_version

    dtypes = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    head, double_quant = _switch("quant_head", head), _switch("double_quant", double_quant)
    given = bnb is not None or head or not double_quant or quant_from not in ("bfloat16", "bf16")
    if given and not quantize:
        raise WorkloadError("bnb, quant_head, double_quant and quant_from describe quantized base weights: give "
                            "quantize=nf4|fp4 too")
    if str(quant_from) not in dtypes:
        raise WorkloadError(f"quant_from must be bfloat16 or float16, got {quant_from!r}")
    if bnb is not None and quantize:
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?", str(bnb)):
            raise WorkloadError(f"bnb must be a bitsandbytes version such as 0.42.0, got {bnb!r}")
        if tuple(int(x) for x in str(bnb).split(".")) < (0, 39):
            raise WorkloadError(f"bnb={bnb}: bitsandbytes has 4-bit weights from 0.39.0 on; give the version the "
                                "run will use, such as 0.42.0")
        installed_version()  # bitsandbytes itself is needed either way
    return QuantOptions(head=head, double_quant=double_quant, from_dtype=dtypes[str(quant_from)],
                        bnb=str(bnb) if bnb is not None else "")


def _switch(name: str, value) -> bool:
    """true/false (yes/no, on/off, 1/0) as a flag is written; anything else is refused, never read as true."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ON:  # the words --checkpointing and a spec read as a switch
        return ON[word]
    raise WorkloadError(f"{name} must be true or false, got {value!r}")


class HFWorkload:

    def __init__(self, path: str, lora=None, data: str | None = None, fields: str | None = None,
                 weights: bool = False, task: str | None = None, num_labels: int | None = None,
                 val_data: str | None = None, on_truncate: str = "warn", quantize: str | None = None,
                 bnb: str | None = None, quant_head: bool = False, double_quant: bool = True,
                 quant_from: str = "bfloat16"):
        try:
            from transformers import AutoConfig
        except ImportError:
            raise WorkloadError("hf: workloads need the hf extra: pip install 'rentplan[hf]'") from None
        self.path = Path(path)
        cfg_file = self.path / "config.json" if self.path.is_dir() else self.path
        if not cfg_file.is_file():
            raise WorkloadError(f"hf:{path}: no config.json there (a folder with config.json, or the file itself).")
        self.dir = cfg_file.parent
        self.config = AutoConfig.from_pretrained(str(self.dir))
        archs = self.config.architectures or []
        self.task = task or ("classification" if any(a.endswith("ForSequenceClassification") for a in archs)
                             else "causal-lm")
        if num_labels:
            self.config.num_labels = int(num_labels)
        self.lora = parse_lora(lora)
        from probes.quantize import COMPUTE_DTYPE, QUANTIZE

        if quantize is not None and quantize not in QUANTIZE:
            raise WorkloadError(f"quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        if quantize and not self.lora:
            raise WorkloadError("quantize needs lora: quantized base weights do not train (QLoRA trains an adapter "
                                "on them), e.g. lora=r=16,alpha=32,targets=q_proj+v_proj")
        self.quantize = quantize
        self.quant_options = _quant_options(quantize, bnb, quant_head, double_quant, quant_from)
        # QLoRA: the base (embeddings, norms, head) in the compute dtype, the linears quantized after building.
        self.base_dtype = COMPUTE_DTYPE if quantize else None
        self.weights = bool(weights)
        self.tokenizer = self._tokenizer()
        self.fields = [f.strip() for f in (fields or ("text,label" if self.task == "classification"
                                                      else "prompt,response")).split(",")]
        if on_truncate not in TRUNCATE:
            raise WorkloadError(f"on_truncate must be one of {', '.join(TRUNCATE)}, got {on_truncate!r}")
        self.on_truncate = on_truncate
        train_file, val_file = _data_files(data, val_data)
        self.rows = self._read(train_file) if train_file else None
        self.val_rows = self._read(val_file) if val_file else None
        self.val_source = (f"validation rows from {val_file}" if val_file else
                           "validation is every 10th row of the data by a hash of its position: pass val_data=FILE "
                           "(--val-data) or a folder written by `rentplan split` for a split that cannot leak")
        self._encoded: dict = {}
        self.lengths = self._lengths() if self.rows is not None and self.tokenizer is not None else None
        layers = getattr(self.config, "num_hidden_layers", "?")
        hidden = getattr(self.config, "hidden_size", "?")
        self.name = (f"hf:{self.config.model_type}-{layers}L-{hidden}" + (f"+{quantize}" if quantize else "")
                     + ("+lora" if self.lora else ""))
        self.data_note = ("tokenized with the tokenizer next to the config" if self.lengths is not None else
                          "random token ids of the configured lengths (no tokenizer or no data given)")

    # --- setup ---

    @property
    def masks_prompt(self) -> bool:
        """A causal LM's prompt tokens are masked out of the loss; a classifier has no prompt."""
        return self.task == "causal-lm"

    def _tokenizer(self):
        if not any((self.dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return None
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(self.dir))
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        return tok

    def _read(self, data: str) -> list[dict]:
        p = Path(data)
        if not p.is_file():
            raise WorkloadError(f"data file {data} not found.")
        rows = []
        with open(p) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise WorkloadError(f"{data} line {n} is not JSON: {e}") from None
                missing = [k for k in self.fields if k not in row]
                if missing:
                    raise WorkloadError(f"{data} line {n} lacks field(s) {', '.join(missing)} "
                                        f"(--fields is {','.join(self.fields)}).")
                rows.append(row)
        if not rows:
            raise WorkloadError(f"{data} has no rows.")
        return rows

    def _encode(self, row: dict) -> tuple[list[int], int]:
        """Token ids of one example and how many leading ids are prompt (masked out of the loss)."""
        tok = self.tokenizer
        if self.task == "classification" or len(self.fields) == 1:
            ids = tok(str(row[self.fields[0]]), add_special_tokens=True)["input_ids"]
            return ids, 0
        prompt = tok(str(row[self.fields[0]]), add_special_tokens=True)["input_ids"]
        response = tok(str(row[self.fields[1]]), add_special_tokens=False)["input_ids"]
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return prompt + response + eos, len(prompt)

    def _encoded_rows(self, split: str) -> list[tuple[list[int], int]]:
        """Token ids and prompt length of every row of a split, computed once."""
        if split not in self._encoded:
            self._encoded[split] = [self._encode(r) for r in self._rows(split)]
        return self._encoded[split]

    def _rows(self, split: str) -> list[dict]:
        if self.val_rows is not None:
            return self.rows if split == "train" else self.val_rows
        pool = [i for i in range(len(self.rows)) if (zlib.crc32(str(i).encode()) % 10 == 0) == (split != "train")]
        return [self.rows[i] for i in (pool or range(len(self.rows)))]

    def cut_at(self, split: str, seq_len: int) -> list[int]:
        """Rows of a split whose response (the tokens the loss sees) is cut at seq_len."""
        return [i for i, (ids, _) in enumerate(self._encoded_rows(split)) if len(ids) > seq_len]

    def data_report(self, seq_lens: dict[str, int]) -> list[str]:
        """Where validation comes from, and per split how many examples seq_len cuts (and what is done)."""
        if self.rows is None or self.tokenizer is None:
            return []
        notes = [self.val_source]
        for split, seq_len in seq_lens.items():
            cut, total = len(self.cut_at(split, seq_len)), len(self._rows(split))
            if not cut:
                continue
            what = {"warn": "trained on cut (the expected output changes: not the same experiment as uncut)",
                    "drop": "left out", "error": ""}[self.on_truncate]
            note = (f"{split}: {cut} of {total} example{'s' if total != 1 else ''} "
                    f"{'are' if cut != 1 else 'is'} longer than seq_len {seq_len}")
            if self.on_truncate == "error":
                raise WorkloadError(f"{note} (on_truncate=error). Raise seq_len, or pass --on-truncate drop|warn.")
            notes.append(f"{note}: {what} (on_truncate={self.on_truncate})")
        return notes

    def _lengths(self) -> dict:
        lens = sorted(len(self._encode(r)[0]) for r in self.rows)
        p99 = lens[min(len(lens) - 1, math.ceil(0.99 * len(lens)) - 1)]
        return {"examples": len(lens), "max": lens[-1], "p99": p99, "median": lens[len(lens) // 2]}

    # --- the contract ---

    def build_model(self):
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if self.task == "classification" else AutoModelForCausalLM
        if self.weights:
            if not any(self.dir.glob("*.safetensors")):
                raise WorkloadError(f"weights=true but no *.safetensors next to {self.dir / 'config.json'}")
            model = cls.from_pretrained(str(self.dir), use_safetensors=True)
        else:
            model = cls.from_config(self.config)
        if self.task == "classification" and model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer else 0
        if self.lora and not self.quantize:  # quantized: LoRA goes on after the base is quantized (after_build)
            model = self._with_lora(model)
        return model

    def _with_lora(self, model):
        from peft import LoraConfig, get_peft_model

        kind = "SEQ_CLS" if self.task == "classification" else "CAUSAL_LM"
        return get_peft_model(model, LoraConfig(task_type=kind, **self.lora))

    def weights_left_on_meta(self, model) -> set[int]:
        """Estimates: the weights that will be quantized are never made unquantized (probes/quantize.py)."""
        from probes.quantize import weights_to_quantize

        return weights_to_quantize(model, self.quant_options.head) if self.quantize else set()

    def memory_note(self, model) -> str:
        """Estimates: what the trace of the quantized layers assumed that the line should say."""
        if not self.quantize or self.quantize == "int8":
            return ""
        from probes.quantize import BnbSemantics, held_note, installed_version

        o, notes = self.quant_options, []
        if o.bnb and BnbSemantics.of(o.bnb) != BnbSemantics.of(installed_version()):
            notes.append(f"4-bit layers traced as bitsandbytes {o.bnb}'s MatMul4Bit (this machine has "
                         f"{installed_version()})")
        notes.append(held_note(model))
        return "; ".join(n for n in notes if n)

    def after_build(self, model, device, fake: bool):
        """QLoRA: quantize the base's linears one at a time, then put LoRA on them."""
        if not self.quantize:
            return model
        from probes.quantize import BnbSemantics, installed_version, quantize

        wanted = self.quant_options.bnb
        if not fake and wanted and BnbSemantics.of(wanted) != BnbSemantics.of(installed_version()):
            raise WorkloadError(f"bnb={wanted}: a measured run uses the installed bitsandbytes "
                                f"{installed_version()}, whose MatMul4Bit keeps other tensors; install "
                                f"bitsandbytes=={wanted} to measure it, or estimate (which traces {wanted}'s)")
        model = quantize(model, self.quantize, device, fake, self.quant_options)
        if not fake:
            return self._with_lora(model)
        # Under the estimate's modes peft's module moves fail on fake parameters: it wraps the layers outside
        # them, and the adapter's (real, small) tensors are then made anew as fake tensors the tracker counts.
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            model = self._with_lora(model)
        return remake_real_tensors(model)

    def make_batch(self, split: str, index: int, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
        if self.rows is not None and self.tokenizer is not None:
            return self._data_batch(split, index, micro_batch, seq_len)
        g = torch.Generator().manual_seed(zlib.crc32(f"{split}:{index}".encode()))
        ids = torch.randint(3, self.config.vocab_size, (micro_batch, seq_len), generator=g)
        mask = torch.ones_like(ids)
        if self.task == "classification":
            labels = torch.randint(0, self.config.num_labels, (micro_batch,), generator=g)
            return {"input_ids": ids, "attention_mask": mask, "labels": labels}
        labels = ids.clone()
        labels[:, : seq_len // 4] = IGNORE  # a quarter of each sequence stands for the prompt
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def _data_batch(self, split: str, index: int, micro_batch: int, seq_len: int) -> dict[str, torch.Tensor]:
        # The split's rows (validation from val_data, else every 10th by a hash of position); with
        # on_truncate=drop, only those that fit seq_len. Deterministic in (split, index).
        rows = self._rows("train" if split == "train" else "val")
        encoded = self._encoded_rows("train" if split == "train" else "val")
        pool = list(range(len(rows)))
        if self.on_truncate != "warn":
            cut = set(self.cut_at("train" if split == "train" else "val", seq_len))
            if cut and self.on_truncate == "error":
                raise WorkloadError(f"{split}: {len(cut)} example(s) longer than seq_len {seq_len} "
                                    "(on_truncate=error)")
            pool = [i for i in pool if i not in cut]
            if not pool:
                raise WorkloadError(f"{split}: every example is longer than seq_len {seq_len}; nothing is left "
                                    "to train on with on_truncate=drop. Raise seq_len.")
        pad = self.tokenizer.pad_token_id
        ids = torch.full((micro_batch, seq_len), pad, dtype=torch.long)
        mask = torch.zeros((micro_batch, seq_len), dtype=torch.long)
        labels = torch.full((micro_batch, seq_len), IGNORE, dtype=torch.long)
        cls_labels = []
        for b in range(micro_batch):
            k = pool[(index * micro_batch + b) % len(pool)]
            row, (tokens, n_prompt) = rows[k], encoded[k]
            tokens = tokens[:seq_len]
            ids[b, : len(tokens)] = torch.tensor(tokens)
            mask[b, : len(tokens)] = 1
            labels[b, n_prompt: len(tokens)] = torch.tensor(tokens[n_prompt:], dtype=torch.long)
            if self.task == "classification":
                cls_labels.append(int(row[self.fields[1]]))
        if self.task == "classification":
            return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(cls_labels)}
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def compute_loss(self, model, batch) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss

    def count_targets(self, batch) -> int:
        if self.task == "classification":
            return int(batch["labels"].numel())
        return int((batch["labels"][:, 1:] != IGNORE).sum())  # HF shifts labels by one inside the model

    def predict(self, model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if self.task == "classification":
            return logits.argmax(-1), batch["labels"]
        keep = batch["labels"][:, 1:] != IGNORE
        return logits[:, :-1].argmax(-1)[keep], batch["labels"][:, 1:][keep]

    def show(self, batch) -> list[dict[str, str]]:
        out = []
        decode = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer else (lambda ids: " ".join(map(str, ids)))
        for i in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            lab = batch["labels"][i]
            if self.task == "classification":
                out.append({"input": decode(ids), "target": str(int(lab)), "mask": "",
                            "loss sees": f"class {int(lab)}"})
                continue
            seen = lab[lab != IGNORE].tolist()
            out.append({"input": decode(ids), "target": decode(seen),
                        "mask": "".join("." if x == IGNORE else "x" for x in lab.tolist()),
                        "loss sees": f"{len(seen)} of {len(lab)} positions"})
        return out


def hf_workload(path: str, **params) -> HFWorkload:
    return HFWorkload(path, **params)


def adapter_weights(model) -> dict | None:
    """The LoRA adapter's tensors, what an export ships for a PEFT model; None when the model has no adapter."""
    # A PeftModel exists only once peft is imported; importing it here instead would run inside a measured phase
    # and count the tensors peft's import makes (an estimate's first export read 144 bytes higher than the next).
    peft = sys.modules.get("peft")
    inner = getattr(model, "module", model)
    if peft is None or not isinstance(inner, peft.PeftModel):
        return None
    return peft.get_peft_model_state_dict(inner)


def export_adapter(model, path: str) -> bool:
    """Write only the LoRA adapter's tensors (safetensors). False when the model has no adapter."""
    tensors = adapter_weights(model)
    if tensors is None:
        return False
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
    return True
