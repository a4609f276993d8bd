"""Rental plans for fixed windows (3, 7, 30 days): which variants fit, what is left out, idle time, cost.

Packing objective, in order: the most priority-1 variants, then the most priority-2, and so on; then the
fewest hours; then the variants declared first. Taking each priority level's shortest variants first is
optimal for it (a shortest-first prefix maximises the count and leaves the most time for later levels);
tests check it against brute-force enumeration. Each variant's hours already hold its training, every
evaluation pass (the final one included) and its export; setup is paid once per window.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from planner.campaign import Campaign
from planner.select import NO_FIT

EPS = 1e-9


@dataclass(frozen=True)
class Item:
    index: int  # declared order
    priority: int
    hours: float


def pack(items: list[Item], capacity_hours: float) -> list[int]:
    """Indices of the chosen items, in declared order."""
    chosen: list[int] = []
    left = capacity_hours
    for level in sorted({i.priority for i in items}):
        for item in sorted((i for i in items if i.priority == level), key=lambda i: (i.hours, i.index)):
            if item.hours <= left + EPS:
                chosen.append(item.index)
                left -= item.hours
    return sorted(chosen)


def objective(items: list[Item], chosen: list[int]) -> tuple:
    """The key `pack` minimises (used by tests to compare against brute force)."""
    levels = sorted({i.priority for i in items})
    picked = [i for i in items if i.index in set(chosen)]
    counts = tuple(-sum(1 for i in picked if i.priority == lv) for lv in levels)
    return counts + (round(sum(i.hours for i in picked), 6), tuple(sorted(chosen)))


def billed_hours(hours: float, minimum: float) -> float:
    return max(hours, minimum)


def plan_windows(sheet: pd.DataFrame, campaign: Campaign, days: list[int]) -> pd.DataFrame:
    """One row per (window, offer that fits): variants in and out, hours, idle, cost; cheapest marked."""
    rows = []
    fitting = sheet[(sheet["verdict"] != NO_FIT) & sheet["variant_hours_high"].notna()]
    p1 = {v.id for v in campaign.variants if v.priority == min(x.priority for x in campaign.variants)}
    for d in days:
        window = d * 24.0
        for _, r in fitting.iterrows():
            per_variant = float(r["variant_hours_high"])  # the conservative end of the range
            items = [Item(i, v.priority, per_variant) for i, v in enumerate(campaign.variants)]
            capacity = window - campaign.setup_hours
            chosen = pack(items, capacity) if capacity > 0 else []
            ids = [campaign.variants[i].id for i in chosen]
            left_out = [v.id for i, v in enumerate(campaign.variants) if i not in chosen]
            used = (campaign.setup_hours + per_variant * len(chosen)) if chosen else 0.0
            used_lo = (campaign.setup_hours + float(r["variant_hours_low"]) * len(chosen)) if chosen else 0.0
            price = float(r["price_per_hour_usd"])
            minimum = _billing_minimum(r)
            rows.append({
                "days": d, "offer": r["offer"], "gpu": r["gpu"], "provider": r["provider"],
                "strategy": r["strategy"], "verdict": r["verdict"],
                "variants_in": ", ".join(ids), "variants_out": ", ".join(left_out),
                "completes_priority_1": p1 <= set(ids),
                "hours_used_low": used_lo, "hours_used_high": used, "idle_hours": max(0.0, window - used),
                "cost_usd_low": price * billed_hours(used_lo, minimum) if chosen else 0.0,
                "cost_usd_high": price * billed_hours(used, minimum) if chosen else 0.0,
                "cost_if_held_whole_window_usd": price * window,
                "price_per_hour_usd": price,
            })
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["cheapest_for_priority_1"] = False
    for d in days:
        ok = df[(df["days"] == d) & df["completes_priority_1"]]
        if not ok.empty:
            df.loc[ok.sort_values(["cost_usd_high", "hours_used_high"]).index[0], "cheapest_for_priority_1"] = True
    return df.sort_values(["days", "cheapest_for_priority_1", "cost_usd_high"], ascending=[True, False, True]) \
        .reset_index(drop=True)


def _billing_minimum(row) -> float:
    return float(row.get("billing_minimum_hours", 0.0) or 0.0)


def recommend(sheet: pd.DataFrame) -> pd.Series | None:
    """The row the selection marked as recommended (planner/select.py: recommended_index)."""
    rec = sheet[sheet["recommended"]] if "recommended" in sheet else sheet.iloc[0:0]
    return None if rec.empty else rec.iloc[0]


def budget_review(sheet: pd.DataFrame, plans: pd.DataFrame, campaign: Campaign) -> dict:
    """Cost per variant (at the recommended offer), per plan (cheapest per window) and per offer; vs the cap."""
    rec = recommend(sheet)
    per_variant = []
    if rec is not None:
        for v in campaign.variants:
            per_variant.append({"variant": v.id, "priority": v.priority,
                                "hours_low": rec["variant_hours_low"], "hours_high": rec["variant_hours_high"],
                                "cost_usd_low": rec["variant_hours_low"] * rec["price_per_hour_usd"],
                                "cost_usd_high": rec["variant_hours_high"] * rec["price_per_hour_usd"]})
    per_plan = []
    if not plans.empty:
        for _, p in plans[plans["cheapest_for_priority_1"]].iterrows():
            per_plan.append({"days": p["days"], "offer": p["offer"], "variants_in": p["variants_in"],
                             "variants_out": p["variants_out"], "cost_usd_high": p["cost_usd_high"],
                             "idle_hours": p["idle_hours"]})
    fitting = sheet[sheet["verdict"] != NO_FIT]
    per_offer = fitting[["offer", "gpu", "provider", "campaign_hours_high", "campaign_cost_usd_low",
                         "campaign_cost_usd_high"]].to_dict(orient="records")
    cap = campaign.budget_usd
    verdict = None
    if cap is not None and rec is not None:
        total = float(rec["campaign_cost_usd_high"])
        under = fitting[fitting["campaign_cost_usd_high"] <= cap]
        verdict = {"cap_usd": cap, "recommended_cost_usd_high": total, "within": total <= cap,
                   "offers_within_cap": int(len(under)),
                   "margin_usd": cap - total}
    return {"recommended": None if rec is None else rec["offer"], "per_variant": per_variant,
            "per_plan": per_plan, "per_offer": per_offer, "budget": verdict}
