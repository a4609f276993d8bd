"""The longest sequence a model can take, and what says so: the planner's max sequence never goes past it.

Read in this order, the first that answers wins:
1. the workload's own `max_seq_len` (attribute or key), when it states one;
2. the model's config: `max_position_embeddings`, `n_positions`, `n_ctx`, `max_seq_len` (Hugging Face names;
   a rotary model's is the length it was trained to, the limit its config states);
3. a learned position table: an `nn.Embedding` whose name says position (`pos`, `wpe`, `position...`), whose
   rows are the positions it can index.
None when nothing states a limit (relative or rotary positions without a config): the search limit stays.
"""

from __future__ import annotations

import torch.nn as nn

CONFIG_NAMES = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")


def _positive_int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def position_limit(workload, model: nn.Module) -> tuple[int | None, str]:
    """(limit, where it was read) or (None, '') when neither the workload nor the model states one."""
    stated = workload.get("max_seq_len") if isinstance(workload, dict) else getattr(workload, "max_seq_len", None)
    if _positive_int(stated):
        return stated, "workload.max_seq_len"
    inner = getattr(model, "module", model)  # DDP/FSDP wrappers keep the model as .module
    config = getattr(inner, "config", None)
    for name in CONFIG_NAMES:
        value = _positive_int(getattr(config, name, None)) if config is not None else None
        if value:
            return value, f"config.{name}"
    for name, module in inner.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and (leaf.startswith(("pos", "wpe")) or "position" in leaf):
            return int(module.num_embeddings), f"position table {name}, {module.num_embeddings} rows"
    return None, ""
