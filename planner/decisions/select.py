"""Selection sheet: one row per catalog offer for a campaign, from ledger lines. Pure functions, no I/O.

Fit rule (bytes throughout): total = need + CUDA context (+ BLAS workspaces and NCCL buffers where they apply);
fits when total × (1 + headroom) <= usable; tight when total <= usable without the headroom (the allocator's
own rule holds it: the headroom is a policy on top, shown as the margin); does not fit only when total > usable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from planner.catalog_records import Catalog, Gpu, Offer
from planner.decisions.evidence import Evidence, choose, kernel_bases, run_facts, why_incomplete
from planner.decisions.selfcheck import estimate_check
from planner.decisions.shapes import agreeing_shape, input_kind
from planner.errors import LedgerError, NoFeasibleGpu
from planner.inputs.campaign_spec import Campaign
from planner.models.kernels import kernel_target
from planner.models.memory_model import (
    SEQ_LIMIT,
    MemoryModel,
    Need,
    allocated_factor,
    build_model,
    max_micro_batch,
    max_seq_len,
)
from planner.models.overheads import (
    CONV_ALLOWANCE,
    DDP_BROADCAST_BYTES,
    ESTIMATE_ALLOWANCE,
    NCCL_BYTES,
    MiB,
    conv_note,
    estimate_note,
    has_convolutions,
    workspace_bytes,
)
from planner.models.overheads import describe as describe_workspace
from planner.models.timing import Throughput, TimeRange, match_catalog_gpu, throughput, update_time
from planner.models.writes import write_time
from planner.shapes import size_text
from planner.units import fmt_bytes, fmt_seconds

FITS, TIGHT, NO_FIT = "fits", "tight", "does not fit"


def fit_verdict(need_bytes: float, context_bytes: float, usable_bytes: float, headroom: float) -> str:
    total = need_bytes + context_bytes
    if total > usable_bytes:
        return NO_FIT
    if total * (1 + headroom) > usable_bytes:
        return TIGHT
    return FITS


def choose_precision(gpu: Gpu, wanted: str) -> tuple[str, str]:
    """The precision to run on this GPU after the stack check, and why."""
    sm = gpu.sm()
    if wanted == "bf16-true":  # no fp16 fallback: pure fp16 training without a scaler underflows
        if gpu.bf16_supported:
            return "bf16-true", "bf16 weights, gradients and optimizer state (bf16-true)" + (
                f" (sm_{gpu.compute_capability})" if sm else "")
        return "fp32", f"bf16-true needs sm_80+ ({gpu.id} is sm_{gpu.compute_capability}): fp32"
    if wanted == "16-true":
        return "16-true", "fp16 weights, gradients and optimizer state (16-true, as asked)"
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
        ck = "on" if campaign.checkpointing else "off"
        own = sorted(set(same["source"].fillna("").replace("", "probe")) - {"probe"}) if "source" in same else []
        how = (f"run your loop ({', '.join(own)}) with them" if own else
               f"probe them: rentplan probe -w {campaign.workload} --optimizer {campaign.optimizer} --checkpointing "
               f"{ck} (with your other options)")
        raise LedgerError(f"no lines with optimizer={campaign.optimizer} checkpointing={ck} for {campaign.workload}."
                          f"{held(same, campaign)} Or {how}.")
    return fam


def held(same: pd.DataFrame, campaign: Campaign) -> str:
    """What the workload's lines were recorded with, and the spec lines that match them (a callback records the
    trainer's optimizer, e.g. the HF Trainer's default adamw_fused, where a spec without `optimizer` says adamw)."""
    pairs = sorted(set(zip(same["optimizer"], same["checkpointing"].astype(bool))))[:4]
    said = []
    for opt, ck in pairs:
        keys = [f"optimizer: {opt}"] if opt != campaign.optimizer else []
        keys += [f"checkpointing: {str(ck).lower()}"] if ck != campaign.checkpointing else []
        said.append(f"optimizer={opt} lines (checkpointing {'on' if ck else 'off'}): to plan from them, write "
                    + " and ".join(f"`{k}`" for k in keys) + " in the spec")
    return f" The ledger holds {'; '.join(said)}." if said else ""


@dataclass
class FamilyModels:
    """The family's models at one precision (and kernel target), from the lines the evidence rule chose. "Family"
    itself always means lines: the campaign's workload, parameters, optimizer and checkpointing (family_lines)."""

    precision: str
    memory: MemoryModel
    throughput: Throughput | None
    evidence: Evidence
    note: str = ""

    @property
    def lines(self) -> pd.DataFrame:
        return self.evidence.lines

    @property
    def facts(self) -> pd.DataFrame:
        return self.evidence.facts


class CampaignFamily:
    """The campaign's family, sized per (precision, target) on demand by one rule (planner/decisions/evidence.py)."""

    def __init__(self, fam_lines: pd.DataFrame, campaign: Campaign, fragmentation: float,
                 catalog: Catalog | None = None):
        self.lines, self.campaign, self.fragmentation = fam_lines, campaign, fragmentation
        self.facts = kernel_bases(run_facts(fam_lines), catalog)  # the catalog names the GPUs runs were measured on
        self.kinds = set(self.facts["gpu_kind"]) - {""}
        # What the model takes, as the user's loop was read (planner/shapes.py): an image's seq_len is its H×W.
        self.kind, self.input = input_kind(fam_lines), agreeing_shape(campaign, fam_lines)
        self.seq, self.seq_note = campaign_seq_len(campaign, fam_lines)
        self.micro_batch = campaign.micro_batch or campaign.effective_batch
        self.one_process_loop = one_process_loop(self.facts)
        self._cache: dict[tuple, FamilyModels | None] = {}

    def exact(self, precision: str, target: str | None = None, world_size: int = 1,
              kind: str | None = None) -> FamilyModels | None:
        kind = kind if kind in self.kinds else None  # a GPU kind with no run of its own ranks as its basis does
        key = (precision, target, world_size, kind)
        if key not in self._cache:
            ev = choose(self.lines, self.facts, precision, self.micro_batch, self.seq, target, world_size, kind)
            model = None if ev is None else build_model(ev.lines, self.fragmentation)
            notes = []
            if ev is not None and model is not None and not ev.measured:  # sized from estimates: checked
                check = estimate_check(self.lines, precision)
                if check is not None:
                    notes.append(check.note)
                    if check.widens:
                        model.widen, model.widen_note = check.ratio, check.note
                if target not in (None, "", "cpu"):
                    steady = ev.facts.get("op_profile_json", pd.Series([], dtype=object))
                    allowances = [(ESTIMATE_ALLOWANCE, estimate_note())]
                    if any(has_convolutions(p, t) for p in steady for t in {target, ev.basis}):
                        allowances.append((CONV_ALLOWANCE, conv_note()))
                    for fraction, why in allowances:
                        model.widen *= 1 + fraction
                        model.widen_note = "; ".join(x for x in (model.widen_note, why) if x)
            note = "; ".join(notes)
            self._cache[key] = (None if model is None or ev is None
                                else FamilyModels(precision, model, throughput(ev), ev, note=note))
        return self._cache[key]

    def get(self, precision: str, target: str | None = None, kind: str | None = None) -> FamilyModels | None:
        """This precision's lines; else bf16/fp16's twin (autocast keeps the same tensors), also where the twin's
        lines are of a nearer kernel basis (the basis comes before the precision); else any other precision's, in a
        fixed order, saying so."""
        fam = self.exact(precision, target, kind=kind)
        twin = {"bf16": "fp16", "fp16": "bf16", "bf16-true": "16-true", "16-true": "bf16-true"}.get(precision)
        twin_fam = self.exact(twin, target, kind=kind) if twin else None
        if fam is not None and (twin_fam is None or fam.evidence.rank <= twin_fam.evidence.rank):
            return fam
        others = ([twin] if twin else []) + sorted(p for p in set(self.facts["precision"])
                                                   if p not in (precision, twin))
        for other in others:
            f = self.exact(other, target, kind=kind)
            if f is not None:
                note = f"memory and FLOPs from {other} lines" if other == twin else \
                    f"no {precision} lines: used {other} lines"
                return FamilyModels(precision, f.memory, f.throughput, f.evidence,
                                    note="; ".join(x for x in (note, f.note) if x))
        return None

    def sharded(self, precision: str, n: int) -> MemoryModel | None:
        """Per-rank memory model of FSDP × n lines (measured ranks or fake-process-group estimates)."""
        fam = self.exact(precision, None, n)
        return None if fam is None else fam.memory

    def any(self) -> bool:
        return bool((self.facts["complete"] & (self.facts["world_size"] == 1)).any()) if len(self.facts) else False


def one_process_loop(facts: pd.DataFrame) -> str:
    """The user's own loop (callbacks, --script) when it wrote every run of the family, each as one process: its
    sources ("hf-trainer", "script", ...), else "". rentplan starts only its own loop under DDP or FSDP; the
    user's loop runs as the user wrote it, so a world size of 1 stays 1 whatever the offer."""
    if facts.empty or "source" not in facts:
        return ""
    sources = set(facts["source"].fillna("probe").replace("", "probe"))
    if "probe" in sources or (pd.to_numeric(facts["world_size"]) > 1).any():
        return ""
    return ", ".join(sorted(sources))


def campaign_seq_len(campaign: Campaign, fam_lines: pd.DataFrame) -> tuple[int, str]:
    if campaign.seq_len:
        return campaign.seq_len, "from the campaign"
    ok = fam_lines[fam_lines["verdict"] == "ok"]
    seq = int(ok["seq_len"].max()) if not ok.empty else int(fam_lines["seq_len"].max())
    return seq, "longest probed (campaign sets no seq_len)"


def observed_times(runs: pd.DataFrame, metrics: pd.DataFrame, campaign: Campaign) -> dict[str, dict]:
    """Median update, evaluation-pass, save and export seconds per device, from this campaign's own runs."""
    out: dict[str, dict] = {}
    mine = runs[runs["campaign"] == campaign.name] if len(runs) else runs
    for device, g in mine.groupby("device_name"):
        m = metrics[metrics["run_id"].isin(g["run_id"])]
        train, val, save, export = (m[m["kind"] == k]["seconds"] for k in ("train", "val", "save", "export"))
        if len(train):
            out[str(device)] = {"update_s": float(train.median()), "updates": int(len(train)),
                                "eval_pass_s": float(val.median()) if len(val) else None,
                                "save_s": float(save.median()) if len(save) else None,
                                "export_s": float(export.median()) if len(export) else None}
    return out


def select(campaign: Campaign, lines: pd.DataFrame, catalog: Catalog, headroom: float = 0.10,
           offers: list[Offer] | None = None, observed: dict[str, dict] | None = None,
           fams: CampaignFamily | None = None) -> pd.DataFrame:
    """The selection sheet: one row per offer, sorted fits first, then by campaign cost; one row recommended."""
    fams = fams or CampaignFamily(family_lines(lines, campaign), campaign, catalog.fragmentation_factor, catalog)
    if not fams.any():
        single = fams.facts[fams.facts["world_size"] == 1] if len(fams.facts) else fams.facts
        if single.empty:
            raise LedgerError(f"only multi-rank lines for {campaign.workload}: plans start from one process. Probe "
                              "once without --strategy (or estimate it) too.")
        raise LedgerError(f"no complete run to plan from: {why_incomplete(fams.lines)}")
    seen = {}
    for device, times in (observed or {}).items():
        g = match_catalog_gpu(device, catalog)
        if g is not None:
            seen[g.id] = {**times, "device": device}
    df = priced_sheet(offers or catalog.offers, catalog, lambda o: sized_row(
        campaign, catalog, catalog.gpu(o.gpu), o, fams, fams.seq, headroom, seen.get(o.gpu)))
    df.attrs["seq_len_note"] = fams.seq_note
    df.attrs["shape_text"] = f"{size_text(fams.kind, fams.seq, fams.input, per_example=True)} ({fams.seq_note})"
    order = {FITS: 0, TIGHT: 1, NO_FIT: 2}
    df["_o"] = df["verdict"].map(order)
    df["_m"] = df["unmodelled"].fillna("") != ""  # what is not modelled (or not sized: ROCm) comes after
    df = df.sort_values(["_o", "_m", "campaign_cost_usd_high", "price_per_hour_usd", "offer"], na_position="last")
    df = df.drop(columns=["_o", "_m"]).reset_index(drop=True)
    df["recommended"] = False
    pick = recommended_index(df)
    if pick is not None:
        df.loc[pick, "recommended"] = True
    return df


def preference(df: pd.DataFrame, cost: str, hours: str, work: tuple[str, ...] = ()) -> pd.DataFrame:
    """Offers a recommendation may name, best first, by one rule used for the sheet's recommendation and each
    window's ★: never a GPU whose software stack rentplan has not sized (ROCm), nor GPUs the user's one-process
    loop would leave idle (`needs_ddp_loop`); fully modelled before an offer
    whose need leaves something out (the row's `unmodelled` says what); fits before tight; no idle GPU before
    idle ones; then the most work (`work`: columns to sort ascending, e.g. minus the variants a window holds per
    priority); then the cheapest (`cost`), the quickest (`hours`) and the id."""
    loop = df["needs_ddp_loop"].fillna(False).astype(bool) if "needs_ddp_loop" in df else False
    ok = df[(df["verdict"] != NO_FIT) & df[cost].notna() & (df["software"] == "cuda") & ~loop]
    keys = ok.assign(_m=ok["unmodelled"].fillna("") != "", _v=ok["verdict"].map({FITS: 0, TIGHT: 1}),
                     _i=ok["idle_gpus"] > 0)
    return keys.sort_values(["_m", "_v", "_i", *work, cost, hours, "offer"])


def recommended_index(sheet: pd.DataFrame):
    """The offer `preference` puts first for the whole campaign's cost (None when nothing qualifies)."""
    best = preference(sheet, "campaign_cost_usd_high", "campaign_hours_high")
    return None if best.empty else best.index[0]


# The price's columns, in sheet order: filled per offer by priced_sheet, never by sizing.
OFFER_COLUMNS = ("offer", "gpu", "provider", "instance", "region", "gpus_per_instance", "nodes", "network", "spot",
                 "price_per_instance_hour_usd", "price_per_hour_usd", "price_per_gpu_hour_usd",
                 "billing_minimum_hours")
SOURCE_COLUMNS = ("as_of", "price_source", "unverified")
COST_COLUMNS = ("campaign_cost_usd_low", "campaign_cost_usd_high")


def _shape(o: Offer) -> str:
    return f"{o.gpu}|{o.gpus_per_instance}|{o.nodes}|{o.network}|{o.network_gbps}|{o.disk_write_mib_s}"


def priced_sheet(offers: list[Offer], catalog: Catalog, size) -> pd.DataFrame:
    """Every offer's row: sized once per shape (GPU, GPUs per instance, nodes, network, disk; offers of one shape
    differ only in price), then joined to the offers' prices as columns, so a 20,000-offer catalog costs little more
    than the shapes it holds. Cost = price × max(campaign hours, the offer's billing minimum)."""
    sized: dict[str, dict] = {}
    for o in offers:
        key = _shape(o)
        if key not in sized:
            sized[key] = size(o)
    prices = pd.DataFrame({
        "offer": [o.id for o in offers], "gpu": [o.gpu for o in offers], "provider": [o.provider for o in offers],
        "instance": [o.instance for o in offers], "region": [o.region for o in offers],
        "spot": [o.spot for o in offers],
        "price_per_instance_hour_usd": [o.price_per_instance_hour_usd for o in offers],
        "price_per_hour_usd": [o.price_per_hour_usd for o in offers],
        "price_per_gpu_hour_usd": [round(o.price_per_gpu_hour_usd, 4) for o in offers],
        "billing_minimum_hours": [o.billing_minimum_hours for o in offers],
        "as_of": [o.as_of for o in offers], "price_source": [o.source for o in offers],
        "unverified": ["; ".join(list(catalog.gpu(o.gpu).unverified) + list(o.unverified)) for o in offers],
        "_shape": [_shape(o) for o in offers]})
    shapes = pd.DataFrame([{**row, "_shape": key} for key, row in sized.items()]).drop(columns="gpu")
    df = prices.merge(shapes, on="_shape", how="left", sort=False)
    price, minimum = df["price_per_hour_usd"].astype(float), df["billing_minimum_hours"].astype(float)
    for end in ("low", "high"):
        hours = pd.to_numeric(df[f"campaign_hours_{end}"], errors="coerce")
        cost = price * hours.where(hours > minimum, minimum)
        df[f"campaign_cost_usd_{end}"] = cost.where(hours.notna())
    first = [c for c in OFFER_COLUMNS if c in df]
    rest = [c for c in shapes.columns if c not in first and c != "_shape"]
    return df[first + rest + list(SOURCE_COLUMNS) + list(COST_COLUMNS)]


def sized_row(campaign: Campaign, catalog: Catalog, gpu: Gpu, offer: Offer, fams: CampaignFamily, seq: int,
              headroom: float, observed: dict | None = None) -> dict:
    """What an offer's shape (GPU, count, nodes, network) holds and how long the campaign takes on it: every
    field of the row but the price's (offer is any offer of that shape; priced_sheet adds the prices)."""
    precision, why = choose_precision(gpu, campaign.precision)
    fam = fams.get(precision, kernel_target(gpu.compute_capability, gpu.software), gpu.id)
    assert fam is not None  # make_plan sizes no row from a ledger without a complete run of the campaign
    workspaces = outside_bytes(fam, gpu, catalog)
    ctx = catalog.context_bytes + workspaces
    budget = gpu.usable_bytes / (1 + headroom) - ctx  # bytes a configuration may need and still fit
    max_mb, mb_extrap = max_micro_batch(fam.memory, seq, campaign.eval.micro_batch, campaign.eval.seq_len, budget)
    # A position table bounds a sequence, not an image's pixels (a ViT's 197 rows count patches).
    positions, positions_basis = fam.evidence.position_limit if fams.kind != "image" else (None, "")
    seq_limit = min(SEQ_LIMIT, positions or SEQ_LIMIT)
    max_seq, seq_extrap = max_seq_len(fam.memory, 1, budget, seq_limit)
    # nothing fits with the headroom: the largest that fits the usable memory itself is planned, called tight, and
    # shown as the GPU's max dimension (without the headroom, said so)
    plan_mb = max_mb or max_micro_batch(fam.memory, seq, campaign.eval.micro_batch, campaign.eval.seq_len,
                                        gpu.usable_bytes - ctx)[0]
    without_headroom = not max_mb and plan_mb > 0
    if without_headroom:
        max_mb = plan_mb
        max_seq, seq_extrap = max_seq_len(fam.memory, 1, gpu.usable_bytes - ctx, seq_limit)
    plan = choose_strategy(campaign, catalog, gpu, offer, fam, precision, seq, plan_mb, headroom,
                           fams.sharded(precision, offer.gpus_per_instance * offer.nodes), fams.one_process_loop)
    need, mb, accum, replicas = plan["need"], plan["micro_batch"], plan["grad_accum"], plan["replicas"]
    if plan["kind"] == "fsdp":  # the single-process search says 0 (states do not fit one GPU); sharded, the
        max_mb, mb_extrap, max_seq, seq_extrap = mb, False, seq, False  # planned shape is what is known to fit
    ctx = plan["context"]
    # Said on every row, not refused: a position table found by its shape may belong to another input (CLIP's
    # text tower has 77 positions while its seq_len is the image side), so this is a warning, not a verdict.
    too_long = (f"the campaign's sequence length {seq:,} is past the model's position limit {positions:,} "
                f"({positions_basis}): check that the model takes it" if positions and seq > positions else "")
    notes = [n for n in (too_long, fam.note, why, *plan["notes"]) if n]
    row = {
        "gpu": gpu.id, "gpus_per_instance": offer.gpus_per_instance, "nodes": offer.nodes,
        "network": offer.network, "usable_bytes": gpu.usable_bytes, "need_bytes": int(need.bytes),
        "need_phase": need.phase,
        "need_basis": need.basis, "need_extrapolated": need.extrapolated, "context_bytes": ctx,
        "context_basis": context_basis(catalog, fam, gpu, replicas),
        "workspace_bytes": workspaces,  # the part of the context a CUDA reserved peak counts (verify compares it)
        "headroom_pct": round(100 * (gpu.usable_bytes - need.bytes - ctx) / gpu.usable_bytes, 1),
        "max_micro_batch": max_mb, "max_micro_batch_extrapolated": mb_extrap,
        "max_dimension_basis": "without the headroom (tight)" if without_headroom else "with the headroom",
        "max_seq_len_at_mb1": max_seq, "max_seq_len_extrapolated": seq_extrap,
        "max_seq_len_bound": (f"FSDP × {replicas}: the planned shape; larger not searched" if plan["kind"] == "fsdp"
                              else f"the model's position limit ({positions_basis})"
                              if positions and max_seq >= positions else
                              "the search limit" if max_seq >= SEQ_LIMIT else "memory"),
        "precision": precision, "micro_batch": mb, "grad_accum": accum, "replicas": replicas,
        "examples_per_update": mb * accum * replicas, "eval_micro_batch": campaign.eval.micro_batch or mb,
        "seq_len": seq, "input_kind": fams.kind,  # input_kind: planner/shapes.py ('' where the lines do not say)
        "strategy": plan["kind"], "strategy_label": plan["label"], "strategy_why": plan["why"],
        "verdict": plan["verdict"],
        "idle_gpus": offer.gpus_per_instance * offer.nodes - replicas,
        "needs_ddp_loop": bool(plan.get("needs_ddp_loop")),
        "evidence": fam.evidence.describe(), "run_ids": ", ".join(fam.evidence.run_ids),
        "kernel_basis": fam.evidence.basis, "kernel_basis_note": fam.evidence.basis_note,
        "min_cuda": gpu.min_cuda, "software": gpu.software, "compute_capability": gpu.compute_capability,
        "unmodelled": "; ".join(x for x in (plan.get("unmodelled", ""), not_sized(gpu)) if x),
        "notes": "; ".join(notes),
    }
    row.update(time_fields(campaign, catalog, gpu, offer, fam, precision, mb, seq, accum, replicas, plan["kind"],
                           fams.kind))
    if observed and replicas == 1:
        row.update(observed_fields(campaign, observed, row))
    return row


def not_sized(gpu: Gpu) -> str:
    """What rentplan's models do not cover on this GPU: on ROCm, HIP's caching allocator, its attention kernels
    and context were never held against a measurement (the need uses CUDA's); such offers are listed, never
    recommended."""
    if gpu.software == "cuda":
        return ""
    return (f"not sized for {gpu.software.upper()}: need and time use CUDA's allocator model, kernels and context "
            "(never recommended; a pilot on that GPU sizes it)")


def choose_strategy(campaign: Campaign, catalog: Catalog, gpu: Gpu, offer: Offer, fam: FamilyModels, precision: str,
                    seq: int, max_mb: int, headroom: float, sharded: MemoryModel | None, own_loop: str = "") -> dict:
    """Single GPU, DDP or FSDP on this offer, and why. One GPU per instance: single. Several: DDP when a replica
    fits one GPU and the replicas make the update faster than one GPU does (all-reduce included); FSDP when
    model states and an example do not fit one GPU. The user's own loop run as one process (own_loop: its
    sources) stays one process: one GPU used, the row marked `needs_ddp_loop` (never recommended nor ordered)."""
    one_ctx, usable = catalog.context_bytes + outside_bytes(fam, gpu, catalog), gpu.usable_bytes
    gpus = offer.gpus_per_instance * offer.nodes
    eval_mb_fixed, eval_seq = campaign.eval.micro_batch, campaign.eval.seq_len

    def plan_at(replicas: int, mb: int) -> dict:
        accum = campaign.effective_batch // (mb * replicas)
        need = fam.memory.need(mb, seq, eval_mb_fixed or mb, eval_seq)
        ctx = one_ctx + (NCCL_BYTES if replicas > 1 else 0)
        if replicas > 1:
            need = ddp_need(need, gradient_bytes(fam, catalog.fragmentation_factor), accum,
                            broadcast_bytes(fam, catalog.fragmentation_factor))
        return {"replicas": replicas, "micro_batch": mb, "grad_accum": accum, "context": ctx,
                "need": need, "verdict": fit_verdict(need.bytes, ctx, usable, headroom), "notes": []}

    def plan_for(replicas: int) -> dict:
        """The largest micro-batch that fits with the headroom, else the largest that fits at all (tight), else the
        smallest; a DDP rank's buckets and NCCL buffers can make a smaller micro-batch than one process's fit.
        A campaign that states its micro-batch is planned at it (a recipe run as 1 × accumulation 4 stays so)."""
        share = campaign.effective_batch // replicas if campaign.effective_batch % replicas == 0 else 0
        if fixed:
            return stated(replicas, share, fixed)
        sizes = [mb for mb in range(min(max(max_mb, 1), share or 1), 0, -1) if share and share % mb == 0] or [1]
        tight = None
        for mb in sizes:
            plan = plan_at(replicas, mb)
            if plan["verdict"] == FITS:
                return plan
            if plan["verdict"] == TIGHT and tight is None:
                tight = plan
        return tight or plan_at(replicas, sizes[-1])

    def stated(replicas: int, share: int, fixed: int) -> dict:
        if not share or share % fixed:  # no whole accumulation at the stated micro-batch over these replicas
            return {**plan_at(1, fixed), "replicas": replicas, "verdict": NO_FIT, "notes": [
                f"micro-batch {fixed} (as the campaign states) does not divide the effective batch "
                f"{campaign.effective_batch} over {replicas} replicas"]}
        plan = plan_at(replicas, fixed)
        if max_mb > fixed and plan["verdict"] != NO_FIT:
            plan["notes"].append(f"micro-batch {fixed} as the campaign states; up to {max_mb} fits here (fewer "
                                 "accumulation steps per update: often faster, so cheaper)")
        return plan

    fixed = campaign.micro_batch
    one = plan_for(1)
    if gpus == 1:
        return {**one, "kind": "single", "label": "single",
                "why": "one GPU per instance" + ("" if one["verdict"] != NO_FIT else
                                                 "; it does not hold the model states and an example")}
    if own_loop:
        return {**one, "kind": "single", "label": "single; needs your loop to run DDP", "needs_ddp_loop": True,
                "notes": one["notes"] + [f"{gpus - 1} of {gpus} GPUs idle: needs your loop to run DDP"],
                "why": f"your own loop ({own_loop}) ran as one process (world size 1): rentplan cannot make it "
                       f"data-parallel, so this offer is planned on 1 of its {gpus} GPUs; needs your loop to run "
                       "DDP (e.g. under torchrun) to use the others, so it is never recommended for this loop"}
    # as many replicas as split the effective batch (at a stated micro-batch, into whole windows of it)
    replicas = max(r for r in range(1, gpus + 1) if campaign.effective_batch % (r * (fixed or 1)) == 0)
    ddp = plan_for(replicas)
    if replicas < gpus:
        ddp["notes"].append(f"{gpus - replicas} of {gpus} GPUs idle: effective batch {campaign.effective_batch} "
                            f"does not split over {gpus}")
    if ddp["verdict"] != NO_FIT and replicas > 1:
        t1, tn = (_time(fam, gpu, precision, p, seq, catalog, offer, kind) for p, kind in ((one, "single"),
                                                                                          (ddp, "ddp")))
        if t1 is None or tn is None or tn.high_s < t1.high_s:
            faster = "" if t1 is None or tn is None else \
                f"; {replicas} replicas: {fmt_seconds(t1.high_s)} → {fmt_seconds(tn.high_s)} per update (slow end)"
            return {**ddp, "kind": "ddp", "label": f"ddp × {replicas}",
                    "why": f"DDP × {replicas}: a replica fits one GPU{faster}, all-reduce included (estimated)"}
        return {**one, "kind": "single", "label": "single",
                "why": f"single GPU: DDP × {replicas} would not be faster ({fmt_seconds(tn.high_s)} vs "
                       f"{fmt_seconds(t1.high_s)} per update, slow end, estimated: the all-reduce outweighs the "
                       "split); "
                       f"{gpus - 1} of {gpus} GPUs would idle"}
    if ddp["verdict"] != NO_FIT:  # the effective batch cannot be split: one replica
        return {**ddp, "kind": "single", "label": "single", "why": "single GPU: the effective batch does not split"}
    fsdp = fsdp_plan(campaign, fam, one_ctx + NCCL_BYTES, usable, headroom, gpus, catalog, seq,
                     fixed or max(max_mb, 1), sharded)
    if fsdp is not None:
        if one["verdict"] != NO_FIT:  # one process fits; a DDP replica (+ buckets, NCCL) does not
            fsdp["why"] = (f"FSDP × {fsdp['replicas']}: one process fits a GPU of {usable / 2**30:.0f} GiB but a DDP "
                           f"replica does not (its gradient buckets and NCCL buffers come on top); sharded over "
                           f"{fsdp['replicas']} GPUs the update fits, all GPUs working")
        return fsdp
    notes = ["model states and one example do not fit one GPU, nor sharded over this offer's GPUs: needs more "
             "or larger GPUs"]
    return {**ddp, "notes": ddp["notes"] + notes, "kind": "ddp" if replicas > 1 else "single",
            "label": f"ddp × {replicas}" if replicas > 1 else "single", "why": "does not fit"}


def ddp_need(single: Need, grads: float, accum: int, broadcast: float = 0.0) -> Need:
    """A DDP rank holds what one process holds, plus its gradient buckets where one process has no gradients:
    outside training (eval, save, export), at setup (beside the parameters' broadcast copies, which can outlive
    the broadcast: overheads.DDP_BROADCAST_BYTES) and, with accumulation, in the first window after a start or a
    resume (no_sync gradients beside the buckets until the first all-reduce). Measured: tests/test_distributed."""
    extra = {"eval", "save", "export"} | ({"first_step", "resume"} if accum > 1 else set())
    per_phase = {ph: b + (grads if ph in extra else 0.0) for ph, b in single.per_phase.items()}
    if "setup" in per_phase:
        per_phase["setup"] += grads + broadcast
    phase = max(per_phase, key=lambda ph: per_phase[ph])
    basis = (f"{single.basis}; DDP: + gradient buckets ({fmt_bytes(grads)}) in {', '.join(sorted(extra | {'setup'}))}"
             f", + the parameters' broadcast copies ({fmt_bytes(broadcast)}) at setup")
    return Need(per_phase[phase], phase, basis, single.extrapolated, per_phase)


def _reserved_factor(fam: FamilyModels, fragmentation: float) -> float:
    """Bytes the pilot counted as allocated become need bytes × this (the family's largest factor)."""
    return float(allocated_factor(fam.lines, fragmentation).max())


def measured_on_cuda(fam: FamilyModels) -> bool:
    return bool(fam.lines["peak_reserved_bytes"].notna().all())


def outside_bytes(fam: FamilyModels, gpu: Gpu, catalog: Catalog) -> int:
    """What the traced tensors leave out (planner/models/overheads.py): the BLAS workspaces. A line measured on a
    CUDA GPU holds its own GPU's in its peak; a target whose workspaces are larger (sm90's 32 MiB cuBLAS workspace
    against 8 MiB elsewhere) adds the difference."""
    target = workspace_bytes(gpu.compute_capability, gpu.software, gpu.arch)
    return max(0, target - measured_workspace_bytes(fam, catalog)) if measured_on_cuda(fam) else target


def measured_workspace_bytes(fam: FamilyModels, catalog: Catalog) -> int:
    """The workspaces already in CUDA lines' peaks: the smallest of their GPUs' (a GPU the catalog does not know:
    CUDA's smallest default)."""
    held = []
    for name in sorted(set(fam.lines["device_name"].fillna(""))):
        src = match_catalog_gpu(name, catalog)
        held.append(workspace_bytes(src.compute_capability, src.software, src.arch) if src else
                    workspace_bytes(None))
    return min(held, default=0)


def context_basis(catalog: Catalog, fam: FamilyModels, gpu: Gpu, replicas: int) -> str:
    parts = [f"CUDA context {fmt_bytes(catalog.context_bytes)} (catalog default)"]
    if not measured_on_cuda(fam):
        parts.append(describe_workspace(gpu.compute_capability, gpu.software, gpu.arch))
    elif (more := outside_bytes(fam, gpu, catalog)) > 0:
        parts.append(f"BLAS workspaces {more / MiB:.0f} MiB more than the measuring GPU's, already in its lines "
                     f"({describe_workspace(gpu.compute_capability, gpu.software, gpu.arch)} on this GPU)")
    if replicas > 1:
        parts.append(f"NCCL buffers {fmt_bytes(NCCL_BYTES)} (NVIDIA/nccl#864, high end)")
    return " + ".join(parts)


def gradient_bytes(fam: FamilyModels, fragmentation: float) -> float:
    """The gradients of the trainable parameters (the setup line's counts), as the need counts bytes."""
    grads = fam.facts["grad_bytes"].max()
    return 0.0 if pd.isna(grads) else float(grads) * _reserved_factor(fam, fragmentation)


def broadcast_bytes(fam: FamilyModels, fragmentation: float) -> float:
    """DDP's setup broadcast of the parameters (and buffers): flattened copies of up to DDP_BROADCAST_BYTES."""
    params = pd.to_numeric(fam.facts["param_bytes"], errors="coerce").max()
    return 0.0 if pd.isna(params) else min(float(params), DDP_BROADCAST_BYTES) * _reserved_factor(fam, fragmentation)


def _time(fam: FamilyModels, gpu: Gpu, precision: str, plan: dict, seq: int, catalog: Catalog, offer: Offer,
          kind: str) -> TimeRange | None:
    if fam.throughput is None:
        return None
    t = update_time(fam.throughput, gpu, precision, plan["micro_batch"], seq, plan["grad_accum"], plan["replicas"],
                    catalog, kind, offer)
    return None if math.isnan(t.high_s) else t


def observed_fields(campaign: Campaign, obs: dict, predicted: dict) -> dict:
    """A campaign already ran on this GPU: its observed times replace the predictions (and say so); a save or
    export it has not timed keeps the predicted figure."""
    t = obs["update_s"]
    ev = obs["eval_pass_s"] if obs["eval_pass_s"] is not None else 0.0
    writes = {}
    for kind in ("save", "export"):
        if obs.get(f"{kind}_s") is not None:
            writes[f"{kind}_s"] = obs[f"{kind}_s"]
            writes[f"{kind}_basis"] = f"{kind} {fmt_seconds(obs[f'{kind}_s'])} observed in this campaign's runs"
    hours = variant_hours(campaign, t, t, ev, ev, writes.get("save_s", predicted.get("save_s")),
                          writes.get("export_s", predicted.get("export_s")))
    return {"update_s_low": t, "update_s_point": t, "update_s_high": t, "eval_pass_s_low": ev, "eval_pass_s_high": ev,
            **writes, **hours,
            "time_basis": f"observed in this campaign's runs on {obs['device']} (median of {obs['updates']} updates)"}


def variant_hours(campaign: Campaign, update_lo: float, update_hi: float, eval_lo: float, eval_hi: float,
                  save_s: float | None, export_s: float | None) -> dict:
    """Every billed hour of a variant, by kind (training, evaluation passes, checkpoint saves, the export), and
    the campaign's (setup once, then every variant)."""
    passes, saves = campaign.eval.passes(campaign.updates), campaign.saves()
    out = {"train_hours_low": campaign.updates * update_lo / 3600,
           "train_hours_high": campaign.updates * update_hi / 3600,
           "eval_hours_low": passes * eval_lo / 3600, "eval_hours_high": passes * eval_hi / 3600,
           "saves_per_variant": saves, "save_hours": saves * (save_s or 0.0) / 3600,
           "export_hours": (export_s or 0.0) / 3600}
    n = len(campaign.variants)
    for end in ("low", "high"):
        v = out[f"train_hours_{end}"] + out[f"eval_hours_{end}"] + out["save_hours"] + out["export_hours"]
        out[f"variant_hours_{end}"] = v
        out[f"campaign_hours_{end}"] = campaign.setup_hours + n * v
    return out


def model_state_bytes(fam: FamilyModels, fragmentation: float) -> float:
    """Parameters + gradients + optimizer state, from the pilot's own accounting (allocated bytes)."""
    params, state = (pd.to_numeric(fam.facts[c], errors="coerce").max()
                     for c in ("param_bytes", "optimizer_state_bytes"))
    return (sum(float(x) for x in (params, state) if pd.notna(x)) * _reserved_factor(fam, fragmentation)
            + gradient_bytes(fam, fragmentation))


def fsdp_plan(campaign, fam: FamilyModels, ctx: float, usable: float, headroom: float, n: int, catalog: Catalog,
              seq: int, mb_limit: int, sharded: MemoryModel | None) -> dict | None:
    """Model states do not fit one GPU: shard them over the offer's n GPUs (FSDP), at the largest micro-batch
    that fits. The per-GPU need comes from FSDP × n lines when the ledger has them (measured ranks or a fake
    process-group estimate); else it is derived from single-process lines (states / n + the rest)."""
    if campaign.effective_batch % n:
        return None
    states = model_state_bytes(fam, catalog.fragmentation_factor)
    eval_mb_fixed, eval_seq = campaign.eval.micro_batch, campaign.eval.seq_len
    share = campaign.effective_batch // n
    stated = campaign.micro_batch  # a stated micro-batch is the only one tried
    for mb in (m for m in range(min(share, mb_limit), 0, -1) if share % m == 0 and m == (stated or m)):
        eval_mb = eval_mb_fixed or mb
        if sharded is not None:
            need = sharded.need(mb, seq, eval_mb, eval_seq)
            basis = f"per rank from FSDP × {n} lines: {need.basis}"
        else:
            need = fam.memory.need(mb, seq, eval_mb, eval_seq)
            need.bytes -= states * (1 - 1 / n)
            basis = (f"estimated for FSDP × {n}: the single-process need less {(1 - 1 / n):.0%} of the model "
                     f"states ({states / 2**30:.2f} GiB: parameters, gradients, optimizer state); all-gather "
                     f"buffers not modelled (estimate --strategy fsdp --nproc {n} to count them)")
        verdict = fit_verdict(need.bytes, ctx, usable, headroom)
        if verdict == NO_FIT:
            continue
        need.basis = basis
        return {"need": need, "verdict": verdict, "micro_batch": mb, "grad_accum": share // mb, "replicas": n,
                "context": ctx, "unmodelled": "" if sharded is not None else
                f"FSDP all-gather buffers not modelled (estimate --strategy fsdp --nproc {n} counts them)",
                "kind": "fsdp", "label": f"fsdp × {n}", "notes": [],
                "why": f"FSDP × {n}: model states ({states / 2**30:.2f} GiB) and an example do not fit one GPU "
                       f"of {usable / 2**30:.0f} GiB; sharded over {n} GPUs they do"}
    return None


TIME_COLUMNS = ("update_s_low", "update_s_point", "update_s_high", "eval_pass_s_low", "eval_pass_s_high", "save_s",
                "save_basis", "eval_basis", "export_s", "export_basis", "time_basis", "train_hours_low",
                "train_hours_high", "eval_hours_low", "eval_hours_high", "saves_per_variant", "save_hours",
                "export_hours", "variant_hours_low", "variant_hours_high", "campaign_hours_low", "campaign_hours_high")


def time_fields(campaign, catalog, gpu, offer, fam: FamilyModels, precision, mb, seq, accum, replicas,
                strategy: str = "single", kind: str = "") -> dict:
    """kind: what the model takes (planner/shapes.py), for the words of the evaluation's basis."""
    tp = fam.throughput
    empty = dict.fromkeys(TIME_COLUMNS)
    if tp is None:
        return {**empty, "time_basis": "no steady line to time from"}
    t = update_time(tp, gpu, precision, mb, seq, accum, replicas, catalog, strategy, offer)
    if math.isnan(t.low_s):
        return {**empty, "time_basis": t.basis}
    ev = campaign.eval
    eval_ratio = (ev.examples * ev.seq_len) / (3 * campaign.effective_batch * seq)  # forward only: 1/3 of training
    eval_basis = (f"{ev.passes(campaign.updates)} evaluation pass(es) of {ev.examples} examples at "
                  f"{size_text(kind, ev.seq_len)}, each timed as a forward pass: a third of a training update's time "
                  f"per {'position' if kind == 'image' else 'token'}")
    bandwidth, source = ((offer.disk_write_mib_s, "the offer's disk_write_mib_s") if offer.disk_write_mib_s else
                         (catalog.disk_write_mib_s, "catalog default, assumed"))
    same_kind = lambda name: getattr(match_catalog_gpu(str(name), catalog), "id", None) == gpu.id  # noqa: E731
    save, export = (write_time(fam.facts, kind, gpu.id, same_kind, bandwidth, source) for kind in ("save", "export"))
    return {
        "update_s_low": t.low_s, "update_s_point": t.point_s, "update_s_high": t.high_s,
        "eval_pass_s_low": t.low_s * eval_ratio, "eval_pass_s_high": t.high_s * eval_ratio,
        "save_s": save.seconds, "save_basis": save.basis, "export_s": export.seconds, "export_basis": export.basis,
        "eval_basis": eval_basis, "time_basis": t.basis,
        **variant_hours(campaign, t.low_s, t.high_s, t.low_s * eval_ratio, t.high_s * eval_ratio, save.seconds,
                        export.seconds),
    }


def require_feasible(sheet: pd.DataFrame, catalog: Catalog) -> None:
    """Raise NoFeasibleGpu naming the largest need, its phase and the closest GPU when nothing fits."""
    if (sheet["verdict"] != NO_FIT).any():
        return
    smallest = sheet.sort_values("need_bytes").iloc[0]  # smallest need over offers (mb=1 where nothing fits)
    closest = sheet.assign(gap=sheet["need_bytes"] + sheet["context_bytes"] - sheet["usable_bytes"]) \
        .sort_values("gap").iloc[0]
    raise NoFeasibleGpu(
        f"no GPU in the catalog fits this campaign: the need is {fmt_bytes(smallest['need_bytes'])} "
        f"(phase {smallest['need_phase']}, micro-batch {smallest['micro_batch']}, "
        f"{size_text(smallest.get('input_kind', ''), int(smallest['seq_len']))}; "
        f"{smallest['need_basis']}) plus {fmt_bytes(smallest['context_bytes'])} CUDA context and the headroom. "
        f"Closest: {closest['gpu']} with {fmt_bytes(closest['usable_bytes'])} usable. "
        "Next: enable checkpointing, shorten eval seq_len, lower --headroom, or add larger GPUs to the catalog.")


# One market: offers a person would not tell apart but by price (same provider, instance type, GPU, count, nodes,
# region, spot, billing minimum): a SkyPilot catalog lists one instance type once per zone. A capacity block of
# an instance type (billed 24 h at least) is bought apart from its on-demand hours, so it is a market of its own.
MARKET = ["provider", "instance", "gpu", "gpus_per_instance", "nodes", "region", "spot", "billing_minimum_hours"]


def best_per_market(sheet: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the sheet people and plans read, the dearer offers left out): per market, the offer with the cheapest
    campaign (then price, then id); the ordered offer is always kept. Every rule that picks an offer prefers the
    cheaper of two offers of one market, so no recommendation or ★ is lost; `plan --all-offers` writes the rest."""
    if sheet.empty:
        return sheet, sheet
    ranked = sheet.sort_values(["campaign_cost_usd_high", "price_per_hour_usd", "offer"], na_position="last")
    best = ranked.groupby(MARKET, dropna=False, sort=False).head(1).index
    keep = sheet.index.isin(best)
    for always in ("ordered", "recommended"):
        if always in sheet:
            keep |= sheet[always].fillna(False).astype(bool).to_numpy()
    kept = sheet[keep]
    kept.attrs = dict(sheet.attrs, dearer_offers=int((~keep).sum()))
    return kept, sheet[~keep]
