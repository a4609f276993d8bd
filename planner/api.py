"""rentplan's Python API for planning: what `rentplan plan` does, callable from a notebook; the command only parses
its options, calls these and prints. No torch and no probes here (probing a grid is probes/api.py).

    from planner import api
    plan = api.plan("campaign.yaml", ledger="rentplan.db", days="3,7,30")
    plan.write("rentplan-out"); print(plan.decision)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from planner.catalog_records import Catalog
from planner.decisions.pipeline import PlanResult, make_plan, ordered, recommend
from planner.decisions.plans import nothing_to_order, window_notes
from planner.decisions.select import observed_times
from planner.errors import InputError
from planner.inputs.campaign_spec import Campaign, load_campaign
from planner.inputs.catalog import load_catalog
from planner.inputs.grid import parse_list, positive_int
from planner.inputs.names import label_problem
from planner.ledger import Ledger
from planner.outputs.orders import order_for
from planner.outputs.render import write_outputs
from planner.units import fmt_usd

Say = Callable[[str], None]


def _silent(msg: str) -> None:
    pass


def parse_days(text: str) -> list[int]:
    """'3,7,30' -> [3, 7, 30]: the rental windows, each once, in order."""
    days = sorted(set(parse_list(text, positive_int, "--days")))  # a window named twice is one window
    if not days:
        raise InputError("--days needs at least one window, e.g. 3,7,30.")
    return days


def check_names(campaign: str | Path | None = None, out: str | Path | None = None) -> None:
    """The campaign file and the output folder reach sky.yaml's file mounts and run lines: a name that cannot is
    refused before anything is read or written."""
    for option, path in (("--campaign", campaign), ("--out", out)):
        why = path is not None and label_problem(str(path))
        if why:
            raise InputError(f"{option} {str(path)!r} {why}; name a folder or file without it.")


@dataclass
class Plan:
    """A plan made from a ledger and a catalog: the selection sheet, the rental windows, the budget and the order.
    `write(out)` writes its files; `decision` says what was decided (the same decision as the files)."""
    campaign: Campaign
    catalog: Catalog
    headroom: float
    result: PlanResult
    order: dict | None
    spec_path: str
    notes: list[str] = field(default_factory=list)

    @property
    def sheet(self) -> pd.DataFrame:
        return self.result.sheet

    @property
    def plans(self) -> pd.DataFrame:
        return self.result.plans

    @property
    def budget(self) -> dict:
        return self.result.budget

    @property
    def lines(self) -> pd.DataFrame:
        return self.result.lines

    @property
    def decision(self) -> str:
        return decision_text(self.sheet)

    @property
    def window_notes(self) -> list[str]:
        return window_notes(self.plans, self.sheet)

    def write(self, out: str | Path, all_offers: bool = False, on_note: Say | None = None) -> list[Path]:
        """selection.csv, plans.csv, order_sheet.md/.html, budget.md, order.json (and sky.yaml where rentplan
        launches the offer) under `out`; all_offers adds selection-all.csv. on_note: told what the files cannot do."""
        if not isinstance(out, (str, Path)) or not str(out):
            raise InputError(f"out must be the path of a folder for the plan's files, got {out!r}")
        check_names(out=out)
        return write_outputs(Path(out), self.campaign, self.sheet, self.plans, self.budget, self.lines,
                             self.catalog, self.headroom, self.order, spec_path=self.spec_path,
                             dearer=self.result.dearer if all_offers else None, on_note=on_note)


def plan(campaign: str | Path, ledger: str | Path = "rentplan.db", catalog: str | Path | None = None,
         days: str | list[int] = "3,7,30", headroom: float = 0.10, offer: str | None = None,
         say: Say | None = None) -> Plan:
    """The plan of the campaign spec at `campaign` from the ledger's lines and the catalog (default: the bundled
    one). offer: the offer order.json is for (None: the recommended one; 'local': this machine). say: told the
    notes a person should read (also kept in Plan.notes)."""
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        (say or _silent)(msg)

    if not isinstance(campaign, (str, Path)) or not str(campaign):
        raise InputError(f"campaign must be the path of a campaign spec (YAML), got {campaign!r}")
    try:
        headroom = float(headroom)
    except (TypeError, ValueError):
        raise InputError(f"headroom must be a fraction such as 0.1, got {headroom!r}") from None
    if isinstance(days, int) and not isinstance(days, bool):
        days = [days]
    if not isinstance(days, (str, list, tuple)):
        raise InputError(f"days must be rental windows in days, as '3,7,30' or [3, 7, 30], got {days!r}")
    check_names(campaign=campaign)
    camp = load_campaign(campaign)
    cat = load_catalog(catalog)
    memory_fixes = {v.id: k for v in camp.variants for k in camp.changed(v) if k != "lr"}
    if memory_fixes:  # said, not hidden: the sheet sizes one configuration
        note("note: the plan sizes and times every variant at the spec's own micro_batch, checkpointing and "
             f"precision; {', '.join(f'{v} ({k})' for v, k in memory_fixes.items())} differ, so their hours "
             "are the control's (probe their settings to see their own)")
    with Ledger(ledger, create=False) as led:
        lines, runs, metrics = led.frame(), led.table("campaign_runs"), led.table("campaign_metrics")
    windows = parse_days(days) if isinstance(days, str) else parse_days(",".join(str(d) for d in days))
    result = make_plan(camp, lines, cat, headroom, windows, observed=observed_times(runs, metrics, camp),
                       offer_id=offer)
    order = order_for(camp, result, cat, headroom, offer)
    if order is not None and order["expect"]["device_kind"] == "rocm":
        note(f"note: no sky.yaml for {order['offer']['id']}: rentplan has not sized ROCm GPUs (its need and time "
             "use CUDA's allocator, kernels and context) and does not launch them; order.json says what was planned")
    return Plan(camp, cat, headroom, result, order, str(campaign), notes)


def decision_text(sheet: pd.DataFrame) -> str:
    """What stdout says was decided: the same decision as the sheet, order.json and sky.yaml."""

    def describe(r):
        return (f"{r['offer']} ({r['gpu']}, {r['strategy_label']}, {r['precision']}, micro-batch {r['micro_batch']} × "
                f"accumulation {r['grad_accum']}); campaign {fmt_usd(r['campaign_cost_usd_low'])}–"
                f"{fmt_usd(r['campaign_cost_usd_high'])}")
    rec, mine = recommend(sheet), ordered(sheet)
    if sheet.attrs.get("order_for_this_machine"):
        return "Ordered: this machine (--offer local)." + (f" Recommended: {describe(rec)}." if rec is not None else "")
    if mine is None:
        return f"Nothing to order: {nothing_to_order(sheet)}."
    text = f"Recommended and ordered: {describe(mine)}." if rec is not None and rec["offer"] == mine["offer"] else (
        f"Ordered (you chose it with --offer): {describe(mine)}.\n"
        + (f"Recommended: {describe(rec)}." if rec is not None else "rentplan recommends no offer."))
    text += f"\nStrategy: {mine['strategy_why']}."
    if mine["unmodelled"]:
        text += f"\nNot modelled: {mine['unmodelled']}."
    return text


__all__ = ["Plan", "check_names", "decision_text", "parse_days", "plan"]
