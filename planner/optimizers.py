"""The optimizers rentplan sizes: one table that validation, `--optimizer`'s help, observation of a user's loop
(probes/observe.optimizer_name) and the order's extras (outputs/orders.workload_extras) all read. No torch.

Adding an optimizer is a row here and its builder in probes/loop.py (OPTIMIZER_BUILDERS, keyed by these names;
a test checks the two agree)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Optimizer:
    name: str  # what the grid, the campaign spec, the ledger and order.json say
    help: str = ""  # a word for `--optimizer`'s help, after the name
    aliases: tuple[str, ...] = ()  # optimizer class names (lowercased) that a user's own loop reports as this one
    extra: str | None = None  # the rentplan extra the rented machine needs for it (outputs/orders.EXTRAS)


TABLE = (
    Optimizer("adamw", "foreach", aliases=("adamw", "adam")),
    Optimizer("adamw_fused"),  # observed as AdamW(fused=True): probes/observe.optimizer_name
    Optimizer("sgd", aliases=("sgd",)),
    Optimizer("adamw8bit", aliases=("adamw8bit", "adam8bit"), extra="quant"),
    Optimizer("paged_adamw8bit", aliases=("pagedadamw8bit",), extra="quant"),
    Optimizer("adafactor", aliases=("adafactor",)),
)
OPTIMIZERS = tuple(o.name for o in TABLE)
BY_NAME = {o.name: o for o in TABLE}
BY_ALIAS = {alias: o.name for o in TABLE for alias in o.aliases}


def optimizer_help() -> str:
    return "comma list of " + ", ".join(f"{o.name} ({o.help})" if o.help else o.name for o in TABLE)


def observed_name(class_name: str) -> str:
    """The table's name for an optimizer class a user's loop ran (lowercased class name); otherwise that name."""
    return BY_ALIAS.get(class_name, class_name)


def optimizer_extra(name: str) -> str | None:
    """The rentplan extra an optimizer needs on the rented machine (None: torch alone)."""
    o = BY_NAME.get(name)
    return o.extra if o else None
