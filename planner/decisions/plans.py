"""Rental plans for fixed windows (3, 7, 30 days): which variants fit, what is left out, idle time, cost.

Packing objective, in order: the most priority-1 variants, then the most priority-2, and so on; then the
fewest hours; then the variants declared first. Taking each priority level's shortest variants first is
optimal for it (a shortest-first prefix maximises the count and leaves the most time for later levels);
tests check it against brute-force enumeration. Each variant's hours already hold its training, every
evaluation pass (the final one included), its checkpoint saves and its export; setup is paid once per window.

Each window's ★ follows the rule of the sheet's recommendation (planner/decisions/select.py: preference) among the
offers that complete the priority-1 variants in it, with one more key before the cost: the work the window holds
(the packing's own objective: most priority-1 variants, then priority-2, ...), so an offer that fits more work is
never passed over for one that is cheaper only because it runs less. Where the ★ is not the recommended offer,
`window_notes` says why.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import pandas as pd

from planner.decisions.select import NO_FIT, preference
from planner.errors import InputError
from planner.inputs.campaign_spec import Campaign
from planner.units import fmt_bytes, fmt_usd

EPS = 1e-9
PER_OFFER = 15  # offers in the budget review's table


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


def plan_windows(sheet: pd.DataFrame, campaign: Campaign, days: list[int]) -> pd.DataFrame:
    """One row per (window, offer that fits): variants in and out, hours, idle, cost; cheapest marked.
    Offers that take the same hours pack the same variants: packed once per (hours, window), then columns."""
    fitting = sheet[(sheet["verdict"] != NO_FIT) & sheet["variant_hours_high"].notna()]
    if fitting.empty:
        return pd.DataFrame()
    variants = campaign.variants
    levels = sorted({v.priority for v in variants})
    p1 = {v.id for v in variants if v.priority == levels[0]}
    hours = fitting["variant_hours_high"].astype(float)  # the conservative end of the range
    hours_lo = fitting["variant_hours_low"].astype(float)
    price = fitting["price_per_hour_usd"].astype(float)
    minimum = pd.to_numeric(fitting.get("billing_minimum_hours"), errors="coerce").fillna(0.0) \
        if "billing_minimum_hours" in fitting else pd.Series(0.0, index=fitting.index)
    frames = []
    for d in days:
        window = d * 24.0
        capacity = window - campaign.setup_hours
        chosen = {h: (pack([Item(i, v.priority, h) for i, v in enumerate(variants)], capacity) if capacity > 0
                      else []) for h in hours.unique()}
        n = hours.map({h: len(c) for h, c in chosen.items()})
        used = (campaign.setup_hours + hours * n).where(n > 0, 0.0)
        used_lo = (campaign.setup_hours + hours_lo * n).where(n > 0, 0.0)
        frames.append(pd.DataFrame({
            "days": d, "offer": fitting["offer"], "gpu": fitting["gpu"], "provider": fitting["provider"],
            "strategy": fitting["strategy"], "strategy_label": fitting["strategy_label"], "verdict": fitting["verdict"],
            "unmodelled": fitting["unmodelled"], "idle_gpus": fitting["idle_gpus"], "software": fitting["software"],
            "needs_ddp_loop": fitting["needs_ddp_loop"] if "needs_ddp_loop" in fitting else False,
            "variants_in": hours.map({h: ", ".join(variants[i].id for i in c) for h, c in chosen.items()}),
            "variants_out": hours.map({h: ", ".join(v.id for i, v in enumerate(variants) if i not in c)
                                       for h, c in chosen.items()}),
            "completes_priority_1": hours.map({h: p1 <= {variants[i].id for i in c} for h, c in chosen.items()}),
            # the work a window holds, as the packing counts it: minus the variants per priority level
            **{f"_w{lv}": hours.map({h: -sum(1 for i in c if variants[i].priority == lv) for h, c in chosen.items()})
               for lv in levels},
            "hours_used_low": used_lo, "hours_used_high": used, "idle_hours": (window - used).clip(lower=0.0),
            "cost_usd_low": (price * used_lo.where(used_lo > minimum, minimum)).where(n > 0, 0.0),
            "cost_usd_high": (price * used.where(used > minimum, minimum)).where(n > 0, 0.0),
            "cost_if_held_whole_window_usd": price * window,
            "price_per_hour_usd": price,
        }))
    df = pd.concat(frames, ignore_index=True)
    df["completes_priority_1"] = df["completes_priority_1"].astype(bool)
    df["cheapest_for_priority_1"] = False
    work = tuple(f"_w{lv}" for lv in levels)
    for d in days:
        best = preference(df[(df["days"] == d) & df["completes_priority_1"]], "cost_usd_high", "hours_used_high",
                          work)
        if not best.empty:
            df.loc[best.index[0], "cheapest_for_priority_1"] = True
    # listed: the ★ first, then what holds the most work, fully modelled first, cheapest; a window that holds
    # nothing last
    df["_m"] = df["unmodelled"].fillna("") != ""
    df = df.sort_values(["days", "cheapest_for_priority_1", *work, "_m", "cost_usd_high"],
                        ascending=[True, False, *[True] * len(work), True, True])
    return df.drop(columns=["_m", *work]).reset_index(drop=True)


def recommend(sheet: pd.DataFrame) -> pd.Series | None:
    """The row the selection marked as recommended (planner/decisions/select.py: recommended_index)."""
    rec = sheet[sheet["recommended"]] if "recommended" in sheet else sheet.iloc[0:0]
    return None if rec.empty else rec.iloc[0]


def ordered(sheet: pd.DataFrame) -> pd.Series | None:
    """The row order.json is for: the recommendation, or the offer named with --offer (None: nothing fits, or
    the order is for this machine)."""
    rows = sheet[sheet["ordered"]] if "ordered" in sheet else sheet.iloc[0:0]
    return None if rows.empty else rows.iloc[0]


def nothing_to_order(sheet: pd.DataFrame) -> str:
    """Why no offer is recommended, in the terms of the rule that recommends (select.preference)."""
    fits = sheet[sheet["verdict"] != NO_FIT]
    if fits.empty:
        return "no offer fits this campaign"
    loop = fits.get("needs_ddp_loop", pd.Series(False, index=fits.index)).fillna(False).astype(bool)
    if loop.all():
        return (f"the offers that fit have several GPUs, and {fits.loc[loop].iloc[0]['strategy_why']}. Add a one-GPU "
                "offer to the catalog, or run your loop under DDP (torchrun, the callback in each rank) and plan "
                "from those lines")
    return "no offer that fits can be recommended (listed but not sized for its software, or without a cost)"


def mark_ordered(sheet: pd.DataFrame, offer_id: str | None) -> pd.DataFrame:
    """The sheet with its `ordered` column: the decision every output (sheet, stdout, order.json, sky.yaml,
    pictures, budget) tells. An unknown id is refused with the nearest ones."""
    out = sheet.copy()
    if offer_id is None:
        out["ordered"] = out["recommended"]
    else:
        out["ordered"] = False
        if offer_id != "local":
            row = offer_row(sheet, offer_id)
            if row["verdict"] == NO_FIT:
                raise InputError(f"offer {offer_id} does not fit this campaign (need {fmt_bytes(row['need_bytes'])} + "
                                 f"{fmt_bytes(row['context_bytes'])} context and workspaces > "
                                 f"{fmt_bytes(row['usable_bytes'])} usable, at micro-batch 1): an order for it would "
                                 "run out of memory. Order one that fits or is tight (selection.csv), or leave out "
                                 "--offer for the recommendation.")
            if bool(row.get("needs_ddp_loop", False)):
                raise InputError(f"offer {offer_id} has {int(row['gpus_per_instance']) * int(row['nodes'])} GPUs, "
                                 f"and {row['strategy_why']}. An order for it would pay for GPUs the loop leaves "
                                 "idle. Order a one-GPU offer (selection.csv), or run your loop under DDP (torchrun, "
                                 "the callback in each rank) and plan from those lines.")
            if pd.isna(row["campaign_cost_usd_high"]):
                raise InputError(f"offer {offer_id} has no time, so no cost: {row['time_basis']}. Order another "
                                 "offer, or complete the catalog's figures for its GPU.")
            out.loc[row.name, "ordered"] = True
    out.attrs = dict(sheet.attrs, ordered_by="you (--offer)" if offer_id else "the recommendation",
                     order_for_this_machine=offer_id == "local")
    return out


def window_notes(plans: pd.DataFrame, sheet: pd.DataFrame) -> list[str]:
    """Why a window's ★ is not the recommended offer: the ★ ranks the work a window holds and its cost there, the
    recommendation the whole campaign's cost."""
    rec = recommend(sheet)
    if rec is None or plans.empty:
        return []
    notes = []
    for d, g in plans.groupby("days", sort=True):
        star = g[g["cheapest_for_priority_1"]]
        if star.empty or star["offer"].iloc[0] == rec["offer"]:
            continue
        s, mine = star.iloc[0], g[g["offer"] == rec["offer"]]
        if mine.empty or not mine["completes_priority_1"].iloc[0]:
            why = f"the recommended {rec['offer']} does not complete the priority-1 variants in {d} days"
        else:
            m = mine.iloc[0]
            why = (f"in {d} days the recommended {rec['offer']} runs {m['variants_in'] or 'nothing'} for "
                   f"{fmt_usd(m['cost_usd_high'])}, while ★ {s['offer']} runs {s['variants_in']} for "
                   f"{fmt_usd(s['cost_usd_high'])}: ★ holds the most work the window allows (by priority), then "
                   "costs least there; the recommendation is the cheapest for the whole campaign")
        notes.append(f"{d} days: ★ {s['offer']} is not the recommendation: {why}.")
    return notes


HOUR_KINDS = ("train", "eval", "save", "export")


def budget_review(sheet: pd.DataFrame, plans: pd.DataFrame, campaign: Campaign) -> dict:
    """Cost per variant (at the ordered offer), by kind of hour, per plan (★ per window) and per offer; vs the
    cap."""
    rec = ordered(sheet) if "ordered" in sheet else recommend(sheet)
    per_variant = []
    if rec is not None:
        kinds = {k: (rec[f"{k}_hours_low"], rec[f"{k}_hours_high"]) if k in ("train", "eval") else
                 (rec[f"{k}_hours"], rec[f"{k}_hours"]) for k in HOUR_KINDS}
        for v in campaign.variants:
            per_variant.append({"variant": v.id, "priority": v.priority,
                                **{f"{k}_hours_{e}": x for k, pair in kinds.items() for e, x in zip(("low", "high"),
                                                                                                pair)},
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
    # The cheapest that fit, in the sheet's order (the selection sheet itself lists every offer's cost).
    per_offer = fitting.head(PER_OFFER)[["offer", "gpu", "provider", "campaign_hours_high", "campaign_cost_usd_low",
                                         "campaign_cost_usd_high"]].to_dict(orient="records")
    cap = campaign.budget_usd
    verdict = None
    if cap is not None and rec is not None:
        total = float(rec["campaign_cost_usd_high"])
        under = fitting[fitting["campaign_cost_usd_high"] <= cap]
        verdict = {"cap_usd": cap, "ordered_cost_usd_high": total, "within": total <= cap,
                   "offers_within_cap": int(len(under)),
                   "margin_usd": cap - total}
    best = recommend(sheet)
    return {"recommended": None if best is None else best["offer"], "ordered": None if rec is None else rec["offer"],
            "per_variant": per_variant,
            "per_plan": per_plan, "per_offer": per_offer, "offers_that_fit": int(len(fitting)), "budget": verdict}


def offer_row(sheet: pd.DataFrame, offer_id: str) -> pd.Series:
    """The sheet's row of an offer id; an unknown id is refused with the nearest ids."""
    rows = sheet[sheet["offer"] == offer_id]
    if rows.empty:
        hint = difflib.get_close_matches(offer_id, list(sheet["offer"]), n=3)
        raise InputError(f"unknown offer {offer_id!r}." + (f" Did you mean {', '.join(hint)}?" if hint else "")
                         + " Use an offer id from the selection sheet, or 'local'.")
    return rows.iloc[0]
