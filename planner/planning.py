"""From campaign + ledger lines + catalog to a selection sheet, plans and a budget review (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd

from planner.campaign import Campaign
from planner.catalog import Catalog
from planner.errors import InputError
from planner.plans import budget_review, plan_windows, recommend
from planner.select import families, family_for, family_lines, require_feasible, select, single_process


@dataclass
class PlanResult:
    sheet: pd.DataFrame
    plans: pd.DataFrame
    budget: dict
    lines: pd.DataFrame  # the campaign family's lines the numbers came from


def make_plan(campaign: Campaign, lines: pd.DataFrame, catalog: Catalog, headroom: float = 0.10,
              days: list[int] | None = None, observed: dict | None = None) -> PlanResult:
    if not 0 <= headroom < 1:
        raise InputError(f"--headroom must be a fraction in [0, 1), got {headroom}.")
    days = days or [3, 7, 30]
    fam = family_lines(lines, campaign)
    sheet = select(campaign, lines, catalog, headroom, observed=observed)
    require_feasible(sheet, catalog)
    plans = plan_windows(sheet, campaign, days)
    return PlanResult(sheet, plans, budget_review(sheet, plans, campaign), fam)


def local_order(campaign: Campaign, result: PlanResult, catalog: Catalog, headroom: float) -> dict:
    """An order for the machine the pilot ran on (CPU): what `rentplan verify` checks against locally."""
    from datetime import datetime, timezone

    from planner.render import provenance

    fams = families(single_process(result.lines), catalog.fragmentation_factor)
    fam = family_for(fams, campaign.precision)
    ok = fam.lines[(fam.lines["verdict"] == "ok") & (fam.lines["phase"] == "steady")]
    row = ok.sort_values(["seq_len", "micro_batch"]).iloc[-1]
    mb, seq = int(row["micro_batch"]), int(row["seq_len"])
    eval_mb, eval_seq = int(row["eval_micro_batch"]), int(row["eval_seq_len"])
    need = fam.memory.need(mb, seq, eval_mb, eval_seq)
    t = float(row["update_s"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "format": "rentplan-order/1", "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "campaign": campaign.name,
        "offer": {"id": "local", "provider": "this machine", "instance": None, "gpus_per_instance": 0,
                  "price_per_instance_hour_usd": 0.0, "as_of": "n/a", "source": "the pilot's own device"},
        "expect": {"device_kind": str(row["device"]).split(":")[0], "gpu_id": None, "gpu_name": row["device_name"],
                   "usable_bytes": int(total), "compute_capability": None, "bf16": None, "fp8": None,
                   "min_cuda": None, "torch": f">= {'.'.join(str(row['torch_version']).split('.')[:2])}", "gpus": 0},
        "settings": {"workload": campaign.workload, "params": campaign.params, "precision": fam.precision,
                     "optimizer": campaign.optimizer, "checkpointing": campaign.checkpointing, "micro_batch": mb,
                     "grad_accum": int(row["grad_accum"]), "replicas": 1, "seq_len": seq,
                     "eval_micro_batch": eval_mb, "eval_seq_len": eval_seq, "strategy": "single"},
        "plan": {"need_bytes": int(need.bytes), "need_phase": need.phase, "need_basis": need.basis,
                 "context_bytes": 0, "headroom": headroom, "update_s_low": t / 2, "update_s_high": t * 2,
                 "time_basis": f"measured on {row['device_name']} ({t:.3f} s), range ×0.5–×2 for machine load"},
        "packages": ["torch", "safetensors"],
        "provenance": provenance(result.lines),
    }


__all__ = ["PlanResult", "make_plan", "local_order", "recommend"]
