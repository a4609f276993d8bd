"""Selection sheet: one row per catalog offer for a campaign, from ledger lines. Pure functions, no I/O.

Fit rule (bytes throughout): total = need + CUDA context; fits when total × (1 + headroom) <= usable;
tight when it fits with the headroom but not with twice the headroom; else does not fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from planner.batching import largest_micro_batch
from planner.campaign import Campaign
from planner.catalog import Catalog, Gpu, Offer
from planner.errors import LedgerError, NoFeasibleGpu
from planner.memory_model import MemoryModel, build_model, max_micro_batch, max_seq_len
from planner.timing import Throughput, throughput_from_lines, update_time
from planner.units import fmt_bytes

FITS, TIGHT, NO_FIT = "fits", "tight", "does not fit"


def fit_verdict(need_bytes: float, context_bytes: float, usable_bytes: float, headroom: float) -> str:
    total = need_bytes + context_bytes
    if total * (1 + headroom) > usable_bytes:
        return NO_FIT
    if total * (1 + 2 * headroom) > usable_bytes:
        return TIGHT
    return FITS


def choose_precision(gpu: Gpu, wanted: str) -> tuple[str, str]:
    """The precision to run on this GPU after the stack check, and why."""
    sm = gpu.sm()
    if wanted == "bf16":
        if gpu.bf16_supported:
            return "bf16", "bf16 supported" + (f" (sm_{gpu.compute_capability})" if sm else "")
        if gpu.fp16_dense_tflops:
            return "fp16", f"bf16 needs sm_80+ ({gpu.id} is sm_{gpu.compute_capability}): fp16 with a gradient scaler"
        return "fp32", f"no bf16 or fp16 tensor support listed for {gpu.id}: fp32"
    if wanted == "fp16":
        return "fp16", "fp16 with a gradient scaler (as asked)"
    return "fp32", "fp32 (as asked)"


def family_lines(lines: pd.DataFrame, campaign: Campaign) -> pd.DataFrame:
    """Lines of the campaign's workload, parameters, optimizer and checkpointing setting."""
    if lines.empty:
        raise LedgerError("the ledger has no lines. Run `rentplan probe` (or `rentplan demo`) first.")
    same = lines[(lines["workload"] == campaign.workload) & (lines["params_json"] == campaign.params_json)]
    if same.empty:
        have = sorted(set(zip(lines["workload"], lines["params_json"])))[:5]
        listed = "; ".join(f"{w} {p}" for w, p in have)
        raise LedgerError(
            f"no ledger lines for workload {campaign.workload} with params {campaign.params_json}. The ledger has: "
            f"{listed}. Probe this workload first: rentplan probe -w {campaign.workload} "
            + " ".join(f"-p {k}={v}" for k, v in campaign.params.items()))
    fam = same[(same["optimizer"] == campaign.optimizer) & (same["checkpointing"] == campaign.checkpointing)]
    if fam.empty:
        raise LedgerError(f"no lines with optimizer={campaign.optimizer} checkpointing="
                          f"{'on' if campaign.checkpointing else 'off'} for {campaign.workload}; probe them first.")
    return fam[fam["world_size"] == 1]


@dataclass
class Family:
    """Models for one precision of the campaign's family."""

    precision: str
    memory: MemoryModel
    throughput: Throughput | None
    lines: pd.DataFrame
    note: str = ""


def families(fam_lines: pd.DataFrame, fragmentation: float) -> dict[str, Family]:
    out = {}
    for prec, group in fam_lines.groupby("precision"):
        model = build_model(group, fragmentation)
        if model is not None:
            out[prec] = Family(prec, model, throughput_from_lines(group), group)
    return out


def family_for(fams: dict[str, Family], precision: str) -> Family | None:
    if precision in fams:
        return fams[precision]
    # bf16 and fp16 autocast keep the same tensors: their memory is interchangeable; fp32 is not.
    twin = {"bf16": "fp16", "fp16": "bf16"}.get(precision)
    if twin in fams:
        f = fams[twin]
        return Family(precision, f.memory, f.throughput, f.lines, note=f"memory and FLOPs from {twin} lines")
    if fams:
        other = sorted(fams)[0]
        f = fams[other]
        return Family(precision, f.memory, f.throughput, f.lines, note=f"no {precision} lines: used {other} lines")
    return None


def campaign_seq_len(campaign: Campaign, fam_lines: pd.DataFrame) -> tuple[int, str]:
    if campaign.seq_len:
        return campaign.seq_len, "from the campaign"
    ok = fam_lines[fam_lines["verdict"] == "ok"]
    seq = int(ok["seq_len"].max()) if not ok.empty else int(fam_lines["seq_len"].max())
    return seq, "longest probed (campaign sets no seq_len)"


def observed_times(runs: pd.DataFrame, metrics: pd.DataFrame, campaign: Campaign) -> dict[str, dict]:
    """Median update, evaluation-pass and export seconds per device, from this campaign's own runs."""
    out: dict[str, dict] = {}
    mine = runs[runs["campaign"] == campaign.name] if len(runs) else runs
    for device, g in mine.groupby("device_name"):
        m = metrics[metrics["run_id"].isin(g["run_id"])]
        train, val, export = (m[m["kind"] == k]["seconds"] for k in ("train", "val", "export"))
        if len(train):
            out[str(device)] = {"update_s": float(train.median()), "updates": int(len(train)),
                                "eval_pass_s": float(val.median()) if len(val) else None,
                                "export_s": float(export.median()) if len(export) else None}
    return out


def select(campaign: Campaign, lines: pd.DataFrame, catalog: Catalog, headroom: float = 0.10,
           offers: list[Offer] | None = None, observed: dict[str, dict] | None = None) -> pd.DataFrame:
    """The selection sheet: one row per offer, sorted fits first, then by campaign cost."""
    fam_lines = family_lines(lines, campaign)
    fams = families(fam_lines, catalog.fragmentation_factor)
    if not fams:
        failed = fam_lines[fam_lines["verdict"] != "ok"]
        raise LedgerError(f"no successful lines to plan from ({len(failed)} failed lines). "
                          "See `rentplan ledger show --verdict oom` and probe smaller configurations.")
    seq, seq_note = campaign_seq_len(campaign, fam_lines)
    seen = {}
    for device, times in (observed or {}).items():
        from planner.timing import match_catalog_gpu

        g = match_catalog_gpu(device, catalog)
        if g is not None:
            seen[g.id] = {**times, "device": device}
    rows = [offer_row(campaign, catalog, catalog.gpu(o.gpu), o, fams, seq, headroom, seen.get(o.gpu))
            for o in (offers or catalog.offers)]
    df = pd.DataFrame(rows)
    df.attrs["seq_len_note"] = seq_note
    order = {FITS: 0, TIGHT: 1, NO_FIT: 2}
    df["_o"] = df["verdict"].map(order)
    df = df.sort_values(["_o", "campaign_cost_usd_high", "price_per_instance_hour_usd"], na_position="last")
    return df.drop(columns="_o").reset_index(drop=True)


def offer_row(campaign: Campaign, catalog: Catalog, gpu: Gpu, offer: Offer, fams: dict[str, Family], seq: int,
              headroom: float, observed: dict | None = None) -> dict:
    precision, why = choose_precision(gpu, campaign.precision)
    fam = family_for(fams, precision)
    ctx = catalog.context_bytes
    budget = gpu.usable_bytes / (1 + headroom) - ctx  # bytes a configuration may need and still fit
    gpus = offer.gpus_per_instance * offer.nodes
    replicas = max(r for r in range(1, gpus + 1) if campaign.effective_batch % r == 0)
    eval_mb_fixed = campaign.eval.micro_batch
    max_mb, mb_extrap = max_micro_batch(fam.memory, seq, eval_mb_fixed, campaign.eval.seq_len, budget)
    max_seq, seq_extrap = max_seq_len(fam.memory, 1, budget)
    mb = largest_micro_batch(campaign.effective_batch, replicas, max(max_mb, 1)) or 1
    accum = campaign.effective_batch // (mb * replicas)
    eval_mb = eval_mb_fixed or mb
    need = fam.memory.need(mb, seq, eval_mb, campaign.eval.seq_len)
    verdict = fit_verdict(need.bytes, ctx, gpu.usable_bytes, headroom)
    strategy = "single" if replicas == 1 else f"ddp × {replicas}"
    notes = [n for n in (fam.note, why) if n]
    if replicas < gpus:
        notes.append(f"{gpus - replicas} of {gpus} GPUs idle: effective batch {campaign.effective_batch} "
                     f"does not split over {gpus}")
    fsdp = None
    if verdict == NO_FIT and gpus > 1:
        fsdp = fsdp_plan(campaign, fam, need.bytes, ctx, gpu.usable_bytes, headroom, gpus, catalog)
    if fsdp is not None:
        need.bytes, need.basis, verdict = fsdp["need"], fsdp["basis"], fsdp["verdict"]
        mb, accum, replicas, strategy = fsdp["micro_batch"], fsdp["grad_accum"], gpus, f"fsdp × {gpus}"
        notes.append(fsdp["why"])
    elif verdict == NO_FIT and max_mb == 0:
        notes.append("model states and one example do not fit one GPU: needs FSDP across the GPUs of a larger "
                     "instance")
    row = {
        "offer": offer.id, "gpu": gpu.id, "provider": offer.provider, "instance": offer.instance,
        "gpus_per_instance": offer.gpus_per_instance, "spot": offer.spot,
        "price_per_instance_hour_usd": offer.price_per_instance_hour_usd,
        "price_per_gpu_hour_usd": round(offer.price_per_gpu_hour_usd, 4),
        "billing_minimum_hours": offer.billing_minimum_hours,
        "usable_bytes": gpu.usable_bytes, "need_bytes": int(need.bytes), "need_phase": need.phase,
        "need_basis": need.basis, "need_extrapolated": need.extrapolated, "context_bytes": ctx,
        "headroom_pct": round(100 * (gpu.usable_bytes - need.bytes - ctx) / gpu.usable_bytes, 1),
        "max_micro_batch": max_mb, "max_micro_batch_extrapolated": mb_extrap,
        "max_seq_len_at_mb1": max_seq, "max_seq_len_extrapolated": seq_extrap,
        "precision": precision, "micro_batch": mb, "grad_accum": accum, "replicas": replicas,
        "examples_per_update": mb * accum * replicas, "eval_micro_batch": eval_mb, "seq_len": seq,
        "strategy": strategy, "verdict": verdict,
        "min_cuda": gpu.min_cuda, "software": gpu.software, "compute_capability": gpu.compute_capability,
        "as_of": offer.as_of, "price_source": offer.source,
        "unverified": "; ".join(list(gpu.unverified) + list(offer.unverified)),
        "notes": "; ".join(notes),
    }
    row.update(time_fields(campaign, catalog, gpu, offer, fam, precision, mb, seq, accum, replicas))
    if observed and replicas == 1:
        row.update(observed_fields(campaign, offer, observed))
    return row


def observed_fields(campaign: Campaign, offer: Offer, obs: dict) -> dict:
    """A campaign already ran on this GPU: its observed times replace the predictions (and say so)."""
    t = obs["update_s"]
    ev = obs["eval_pass_s"] if obs["eval_pass_s"] is not None else 0.0
    ex = obs["export_s"] if obs["export_s"] is not None else 0.0
    per_variant = (campaign.updates * t + campaign.eval.passes(campaign.updates) * ev + ex) / 3600
    hours = campaign.setup_hours + len(campaign.variants) * per_variant
    price = offer.price_per_instance_hour_usd
    cost = price * max(hours, offer.billing_minimum_hours)
    return {"update_s_low": t, "update_s_high": t, "eval_pass_s_low": ev, "eval_pass_s_high": ev, "export_s": ex,
            "time_basis": f"observed in this campaign's runs on {obs['device']} (median of {obs['updates']} updates)",
            "variant_hours_low": per_variant, "variant_hours_high": per_variant, "campaign_hours_low": hours,
            "campaign_hours_high": hours, "campaign_cost_usd_low": cost, "campaign_cost_usd_high": cost}


def model_state_bytes(fam: Family, fragmentation: float) -> float:
    """Parameters + gradients + optimizer state, from the pilot's own accounting (allocated bytes)."""
    ok = fam.lines[fam.lines["verdict"] == "ok"]
    params = ok[ok["phase"] == "setup"]["param_bytes"].max()
    state = ok[ok["phase"] == "first_step"]["optimizer_state_bytes"].max()
    first = ok[ok["phase"] == "first_step"]
    trainable = first["trainable_param_count"].max() if len(first) else 0
    count = ok[ok["phase"] == "setup"]["param_count"].max()
    grads = params * (trainable / count) if count else params
    total = sum(float(x) for x in (params, grads, state) if pd.notna(x))
    return total * (1.0 if ok["peak_reserved_bytes"].notna().all() else fragmentation)


def fsdp_plan(campaign, fam: Family, single_need: float, ctx: float, usable: float, headroom: float, n: int,
              catalog: Catalog) -> dict | None:
    """Model states do not fit one GPU: shard them over the instance's n GPUs (FSDP). The per-GPU need is
    derived from single-process lines (states / n + the rest), so it is an estimate and says so."""
    if campaign.effective_batch % n:
        return None
    states = model_state_bytes(fam, catalog.fragmentation_factor)
    need = single_need - states * (1 - 1 / n)
    verdict = fit_verdict(need, ctx, usable, headroom)
    if verdict == NO_FIT:
        return None
    mb = largest_micro_batch(campaign.effective_batch, n, 1) or 1
    return {"need": need, "verdict": verdict, "micro_batch": mb, "grad_accum": campaign.effective_batch // (mb * n),
            "basis": f"estimated for FSDP × {n}: the single-process need less {(1 - 1 / n):.0%} of the model states "
                     f"({states / 2**30:.2f} GiB: parameters, gradients, optimizer state); all-gather buffers "
                     f"not modelled",
            "why": f"model states do not fit one GPU: FSDP shards parameters, gradients and optimizer state over "
                   f"{n} GPUs (micro-batch 1 per rank; probe with --strategy fsdp --nproc {n} to measure)"}


def time_fields(campaign, catalog, gpu, offer, fam: Family, precision, mb, seq, accum, replicas) -> dict:
    tp = fam.throughput
    empty = {"update_s_low": None, "update_s_high": None, "eval_pass_s_low": None, "eval_pass_s_high": None,
             "export_s": None, "time_basis": "no steady line to time from", "variant_hours_low": None,
             "variant_hours_high": None, "campaign_hours_low": None, "campaign_hours_high": None,
             "campaign_cost_usd_low": None, "campaign_cost_usd_high": None}
    if tp is None:
        return empty
    t = update_time(tp, gpu, precision, mb, seq, accum, replicas, catalog)
    if math.isnan(t.low_s):
        return {**empty, "time_basis": t.basis}
    ev = campaign.eval
    eval_ratio = (ev.examples * ev.seq_len) / (3 * campaign.effective_batch * seq)  # forward only: 1/3 of training
    lines = fam.lines
    export = lines[(lines["phase"] == "export") & (lines["verdict"] == "ok") & (lines["mode"] == "measured")]["seconds"]
    export_s = float(export.max()) if len(export) else 0.0
    export_basis = f"export {export_s:.2f} s measured on {tp.device}" if len(export) else "export time not measured"
    passes = ev.passes(campaign.updates)
    var_lo = (campaign.updates * t.low_s + passes * t.low_s * eval_ratio + export_s) / 3600
    var_hi = (campaign.updates * t.high_s + passes * t.high_s * eval_ratio + export_s) / 3600
    n = len(campaign.variants)
    hours_lo, hours_hi = campaign.setup_hours + n * var_lo, campaign.setup_hours + n * var_hi
    price = offer.price_per_instance_hour_usd
    return {
        "update_s_low": t.low_s, "update_s_high": t.high_s,
        "eval_pass_s_low": t.low_s * eval_ratio, "eval_pass_s_high": t.high_s * eval_ratio, "export_s": export_s,
        "time_basis": f"{t.basis}; {export_basis}",
        "variant_hours_low": var_lo, "variant_hours_high": var_hi,
        "campaign_hours_low": hours_lo, "campaign_hours_high": hours_hi,
        "campaign_cost_usd_low": price * max(hours_lo, offer.billing_minimum_hours),
        "campaign_cost_usd_high": price * max(hours_hi, offer.billing_minimum_hours),
    }


def require_feasible(sheet: pd.DataFrame, catalog: Catalog) -> None:
    """Raise NoFeasibleGpu naming the largest need, its phase and the closest GPU when nothing fits."""
    if (sheet["verdict"] != NO_FIT).any():
        return
    worst = sheet.sort_values("need_bytes").iloc[0]  # smallest need over offers (mb=1 where nothing fits)
    closest = sheet.assign(gap=sheet["need_bytes"] + sheet["context_bytes"] - sheet["usable_bytes"]) \
        .sort_values("gap").iloc[0]
    raise NoFeasibleGpu(
        f"no GPU in the catalog fits this campaign: the need is {fmt_bytes(worst['need_bytes'])} "
        f"(phase {worst['need_phase']}, micro-batch {worst['micro_batch']}, seq_len {worst['seq_len']}; "
        f"{worst['need_basis']}) plus {fmt_bytes(worst['context_bytes'])} CUDA context and the headroom. "
        f"Closest: {closest['gpu']} with {fmt_bytes(closest['usable_bytes'])} usable. "
        "Next: enable checkpointing, shorten eval seq_len, lower --headroom, or add larger GPUs to the catalog.")
