"""From campaign + ledger lines + catalog to a selection sheet, plans and a budget review (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from planner.catalog_records import Catalog
from planner.decisions.plans import budget_review, mark_ordered, ordered, plan_windows, recommend
from planner.decisions.select import CampaignFamily, best_per_market, family_lines, require_feasible, select
from planner.errors import InputError
from planner.inputs.campaign_spec import Campaign


@dataclass
class PlanResult:
    sheet: pd.DataFrame
    plans: pd.DataFrame
    budget: dict
    lines: pd.DataFrame  # the campaign family's lines
    families: CampaignFamily  # the rule that chose which of them size the campaign
    dearer: pd.DataFrame | None = None  # offers left out of the sheet: a dearer offer of a market it holds


def make_plan(campaign: Campaign, lines: pd.DataFrame, catalog: Catalog, headroom: float = 0.10,
              days: list[int] | None = None, observed: dict | None = None, offer_id: str | None = None) -> PlanResult:
    """offer_id: the offer order.json is for (None: the recommendation; 'local': this machine): the sheet marks it
    `ordered`, and the budget prices the variants on it."""
    if not 0 <= headroom < 1:
        raise InputError(f"--headroom must be a fraction in [0, 1), got {headroom}.")
    days = days or [3, 7, 30]
    fams = CampaignFamily(family_lines(lines, campaign), campaign, catalog.fragmentation_factor, catalog)
    sheet = select(campaign, lines, catalog, headroom, observed=observed, fams=fams)
    require_feasible(sheet, catalog)
    sheet, dearer = best_per_market(mark_ordered(sheet, offer_id))
    plans = plan_windows(sheet, campaign, days)
    return PlanResult(sheet, plans, budget_review(sheet, plans, campaign), fams.lines, fams, dearer)


__all__ = ["PlanResult", "make_plan", "ordered", "recommend"]
