"""From campaign + ledger lines + catalog to a selection sheet, plans and a budget review (pure)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd

from planner.campaign import Campaign
from planner.catalog import Catalog
from planner.errors import InputError, LedgerError
from planner.memory_model import max_micro_batch
from planner.plans import budget_review, plan_windows, recommend
from planner.select import Families, family_lines, require_feasible, select


@dataclass
class PlanResult:
    sheet: pd.DataFrame
    plans: pd.DataFrame
    budget: dict
    lines: pd.DataFrame  # the campaign family's lines
    families: Families  # the rule that chose which of them size the campaign


def make_plan(campaign: Campaign, lines: pd.DataFrame, catalog: Catalog, headroom: float = 0.10,
              days: list[int] | None = None, observed: dict | None = None) -> PlanResult:
    if not 0 <= headroom < 1:
        raise InputError(f"--headroom must be a fraction in [0, 1), got {headroom}.")
    days = days or [3, 7, 30]
    fams = Families(family_lines(lines, campaign), campaign, catalog.fragmentation_factor)
    sheet = select(campaign, lines, catalog, headroom, observed=observed, fams=fams)
    require_feasible(sheet, catalog)
    plans = plan_windows(sheet, campaign, days)
    return PlanResult(sheet, plans, budget_review(sheet, plans, campaign), fams.lines, fams)


def local_order(campaign: Campaign, result: PlanResult, catalog: Catalog, headroom: float) -> dict:
    """An order for the machine the pilot ran on (CPU), at the campaign's shape: its effective batch, seq_len
    and evaluation; what `rentplan verify` checks against locally. Times come from this machine's own lines."""
    from datetime import datetime, timezone

    from planner.batching import largest_micro_batch
    from planner.render import provenance

    fam = result.families.get(campaign.precision)
    local = fam.facts[(fam.facts["mode"] == "measured") & fam.facts["update_s"].notna()] if fam else None
    if local is None or local.empty or fam.evidence.rank not in (0, 2):
        raise LedgerError("no measured run of this campaign's family on this machine to order from: run "
                          "`rentplan probe` here first (estimates time nothing).")
    row = local.iloc[0]  # nearest the campaign's shape
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    seq, eval_seq = result.families.seq, campaign.eval.seq_len
    fitting, _ = max_micro_batch(fam.memory, seq, campaign.eval.micro_batch, eval_seq, total * (1 - headroom),
                                 limit=campaign.effective_batch)
    mb = largest_micro_batch(campaign.effective_batch, 1, max(fitting, 1)) or 1
    accum = campaign.effective_batch // mb
    eval_mb = campaign.eval.micro_batch or mb
    need = fam.memory.need(mb, seq, eval_mb, eval_seq)
    per_token = float(row["update_s"]) / (int(row["micro_batch"]) * int(row["seq_len"]) * int(row["grad_accum"]))
    t = per_token * mb * seq * accum
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
                     "grad_accum": accum, "replicas": 1, "seq_len": seq,
                     "eval_micro_batch": eval_mb, "eval_seq_len": eval_seq, "strategy": "single"},
        "plan": {"need_bytes": int(need.bytes), "need_phase": need.phase, "need_basis": need.basis,
                 "context_bytes": 0, "headroom": headroom, "update_s_low": t / 2, "update_s_high": t * 2,
                 "time_basis": f"measured on {row['device_name']} at micro-batch {int(row['micro_batch'])} × seq "
                               f"{int(row['seq_len'])} ({float(row['update_s']):.3f} s per update), scaled by tokens "
                               f"to the campaign's {mb * accum} × {seq}; range ×0.5–×2 for machine load",
                 "run_ids": fam.evidence.run_ids},
        "packages": ["torch", "safetensors"],
        "provenance": provenance(fam.lines),
    }


__all__ = ["PlanResult", "make_plan", "local_order", "recommend"]
