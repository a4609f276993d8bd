"""order.json: made by one builder from a sheet row (a catalog offer, or this machine as an offer), and read back
by `rentplan verify` with every problem named at once, before anything acts on it. An order names a workload by
reference only; the reference is resolved under the same rules as any other (probes/workloads.py: the user's
own function or class)."""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping

import pandas as pd

from planner.batching import largest_micro_batch
from planner.decisions.plans import ordered, recommend
from planner.errors import InputError, LedgerError
from planner.inputs.schema import order_models, validate
from planner.inputs.yamlsafe import Problems, no_duplicate_keys
from planner.models.memory_model import max_micro_batch
from planner.optimizers import OPTIMIZERS, optimizer_extra
from planner.records import PRECISIONS

FORMAT = "rentplan-order/1"
DEVICE_KINDS = ("cuda", "rocm", "cpu")
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_ORDER_BYTES = 16 * 1024 * 1024
TORCH_REQUIREMENT = re.compile(r"torch(==\d+(\.\d+){1,3}|>=\d+(\.\d+){1,3})")


def provenance(lines: pd.DataFrame) -> list[dict]:
    """Where the numbers came from: one row per (mode, device, torch) with line counts and dates."""
    rows = []
    keys = ["mode", "device", "device_name", "torch_version", "cuda_version"]
    for k, g in lines.fillna({"cuda_version": "none"}).groupby(keys, dropna=False):
        rec = dict(zip(keys, k))
        rec.update({"lines": int(len(g)), "first": str(g["started_at"].min()), "last": str(g["started_at"].max())})
        rows.append(rec)
    return rows


TORCH_VERSION = re.compile(r"\d+(\.\d+){1,3}")


def newest_version(versions) -> str | None:
    """The newest release among versions as torch reports them ('2.13.0+cpu' -> '2.13.0'), by number, not text."""
    found = {m.group(0) for v in versions if v and (m := TORCH_VERSION.match(str(v)))}
    return max(found, key=lambda v: tuple(int(x) for x in v.split(".")), default=None)


def torch_requirement(versions) -> str:
    """The torch the pilot ran, as a pip requirement (a +cpu build's version, without +cpu: on Linux PyPI's wheel
    of that version is the CUDA build)."""
    newest = newest_version(versions)
    return f"torch=={newest}" if newest else "torch>=2.4"


def stack_for(rec: pd.Series, lines: pd.DataFrame) -> dict:
    newest = newest_version(lines["torch_version"].dropna())
    cuda = newest_version(lines["cuda_version"].dropna())
    torch_min = ".".join(newest.split(".")[:2]) if newest else "2.4"
    if rec["software"] == "rocm":
        return {"driver": "ROCm build of PyTorch", "torch": f">= {torch_min} (ROCm build)", "cuda": "n/a (ROCm)"}
    floor = rec["min_cuda"] or "12.1"
    cuda = newest_version([floor, cuda]) or floor  # the pilot's CUDA where newer than the GPU's minimum
    return {"driver": "NVIDIA driver supporting the CUDA below", "torch": f">= {torch_min} (CUDA build)",
            "cuda": f">= {cuda}"}


# The extras of rentplan a workload needs on the rented machine, and the modules each one brings (what `verify`
# checks are importable). Names fixed here: they reach sky.yaml's pip line.
EXTRAS = {"probe": ["torch", "safetensors"], "hf": ["transformers", "peft"], "quant": ["bitsandbytes"],
          "callbacks": ["lightning"]}


def workload_extras(workload: str, params: dict, optimizer: str) -> list[str]:
    """hf: configs and the HF Trainer's callback need transformers (and peft for LoRA); QLoRA base weights and 8-bit
    optimizers need bitsandbytes (each optimizer's extra: planner/optimizers.py); Lightning's callback needs
    lightning."""
    extras = ["probe"]
    if workload.startswith(("hf:", "trainer:")):
        extras.append("hf")
    if workload.startswith("lightning:"):
        extras.append("callbacks")
    if (params or {}).get("quantize"):
        extras.append("quant")
    extra = optimizer_extra(optimizer)
    if extra and extra not in extras:
        extras.append(extra)
    return extras


def order_stack(campaign, device_kind: str, lines: pd.DataFrame) -> dict:
    """What the machine must run: the torch the pilot ran (its build for the device kind) and rentplan's extras."""
    extras = workload_extras(campaign.workload, campaign.params, campaign.optimizer)
    return {"torch_requirement": torch_requirement(list(lines["torch_version"].dropna())),
            "torch_build": device_kind, "extras": extras,
            "packages": [m for e in extras for m in EXTRAS[e]]}


def order_document(campaign, row: Mapping, expect: dict, lines: pd.DataFrame, headroom: float) -> dict:
    """The order: what to rent (the row's offer), at which settings, with what plan, and what `rentplan verify`
    must find on the machine (expect). Every order is made here, for a catalog offer or for this machine."""
    return {
        "format": FORMAT,
        "generated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "campaign": campaign.name,
        "offer": {"id": row["offer"], "provider": row["provider"], "instance": row["instance"],
                  "gpus_per_instance": int(row["gpus_per_instance"]), "nodes": int(row["nodes"]),
                  "spot": bool(row["spot"]), "region": row.get("region"), "network": row["network"],
                  "price_per_instance_hour_usd": float(row["price_per_instance_hour_usd"]),
                  "price_per_hour_usd": float(row["price_per_hour_usd"]),
                  "as_of": row["as_of"], "source": row["price_source"]},
        "expect": expect,
        "settings": {"workload": campaign.workload, "params": campaign.params, "precision": row["precision"],
                     "optimizer": campaign.optimizer, "checkpointing": campaign.checkpointing,
                     "micro_batch": int(row["micro_batch"]), "grad_accum": int(row["grad_accum"]),
                     "replicas": int(row["replicas"]), "seq_len": int(row["seq_len"]),
                     "eval_micro_batch": int(row["eval_micro_batch"]), "eval_seq_len": campaign.eval.seq_len,
                     "strategy": row["strategy"], "strategy_label": row["strategy_label"]},
        "plan": {"need_bytes": int(row["need_bytes"]), "need_phase": row["need_phase"], "need_basis": row["need_basis"],
                 "context_bytes": int(row["context_bytes"]), "context_basis": row["context_basis"],
                 "workspace_bytes": int(row["workspace_bytes"]),
                 "headroom": headroom, "update_s_point": row.get("update_s_point"), "run_ids": row["run_ids"],
                 "update_s_low": row["update_s_low"], "update_s_high": row["update_s_high"],
                 "time_basis": row["time_basis"]},
        "stack": order_stack(campaign, expect["device_kind"], lines),
        "provenance": provenance(lines),
    }


def offer_order(campaign, rec: pd.Series, lines: pd.DataFrame, catalog, headroom: float) -> dict:
    """The order for one row of the selection sheet; the machine must hold the catalog's GPU."""
    gpu = catalog.gpu(rec["gpu"])
    offer = next((o for o in catalog.offers if o.id == rec["offer"]), None)
    expect = {"device_kind": "cuda" if gpu.software == "cuda" else "rocm", "gpu_id": gpu.id, "gpu_name": gpu.name,
              "usable_bytes": int(gpu.usable_bytes), "compute_capability": gpu.compute_capability,
              "bf16": gpu.bf16_supported, "fp8": gpu.fp8_supported, "min_cuda": gpu.min_cuda,
              "torch": stack_for(rec, lines)["torch"], "gpus": int(rec["gpus_per_instance"])}
    return order_document(campaign, {**rec.to_dict(), "region": offer.region if offer else None}, expect, lines,
                          headroom)


def local_order(campaign, result, headroom: float) -> dict:
    """The order for the machine the pilot ran on (CPU), as an offer of its own at the campaign's shape (its
    effective batch, seq_len and evaluation): what `rentplan verify` checks against locally. Times come from
    this machine's own lines, scaled by tokens."""
    fam = result.families.get(campaign.precision)
    local = fam.facts[(fam.facts["mode"] == "measured") & fam.facts["update_s"].notna()] if fam else None
    if local is None or local.empty or not fam.evidence.measured:
        raise LedgerError("no measured run of this campaign's family on this machine to order from: run "
                          "`rentplan probe` here first (estimates time nothing).")
    run = local.iloc[0]  # nearest the campaign's shape
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    seq, eval_seq = result.families.seq, campaign.eval.seq_len
    fitting, _ = max_micro_batch(fam.memory, seq, campaign.eval.micro_batch, eval_seq, total * (1 - headroom),
                                 limit=campaign.effective_batch)
    mb = largest_micro_batch(campaign.effective_batch, 1, max(fitting, 1)) or 1
    accum = campaign.effective_batch // mb
    eval_mb = campaign.eval.micro_batch or mb
    need = fam.memory.need(mb, seq, eval_mb, eval_seq)
    per_token = float(run["update_s"]) / (int(run["micro_batch"]) * int(run["seq_len"]) * int(run["grad_accum"]))
    t = per_token * mb * seq * accum
    row = {"offer": "local", "provider": "this machine", "instance": None, "gpus_per_instance": 0, "nodes": 1,
           "spot": False, "region": None, "network": None, "price_per_instance_hour_usd": 0.0,
           "price_per_hour_usd": 0.0, "as_of": "n/a", "price_source": "the pilot's own device",
           "precision": fam.precision, "micro_batch": mb, "grad_accum": accum, "replicas": 1, "seq_len": seq,
           "eval_micro_batch": eval_mb, "strategy": "single", "strategy_label": "single",
           "need_bytes": need.bytes, "need_phase": need.phase, "need_basis": need.basis,
           "context_bytes": 0, "context_basis": "none: the pilot's own process on this machine", "workspace_bytes": 0,
           "update_s_point": None, "run_ids": fam.evidence.run_ids, "update_s_low": t / 2, "update_s_high": t * 2,
           "time_basis": f"measured on {run['device_name']} at micro-batch {int(run['micro_batch'])} × seq "
                         f"{int(run['seq_len'])} ({float(run['update_s']):.3f} s per update), scaled by tokens to "
                         f"the campaign's {mb * accum} × {seq}; range ×0.5–×2 for machine load"}
    expect = {"device_kind": str(run["device"]).split(":")[0], "gpu_id": None, "gpu_name": run["device_name"],
              "usable_bytes": int(total), "compute_capability": None, "bf16": None, "fp8": None, "min_cuda": None,
              "torch": f">= {'.'.join(str(run['torch_version']).split('.')[:2])}", "gpus": 0}
    return order_document(campaign, row, expect, fam.lines, headroom)


def load_order(path: str | Path) -> dict:
    p = Path(path)
    try:
        if p.stat().st_size > MAX_ORDER_BYTES:
            raise InputError(f"{p} is over {MAX_ORDER_BYTES >> 20} MiB: not an order.json.")
        order = json.loads(p.read_bytes().decode("utf-8"), object_pairs_hook=no_duplicate_keys)  # a key twice: refused
    except (OSError, ValueError) as e:  # ValueError covers bad JSON and bad UTF-8 (and a key given twice)
        raise InputError(f"{p} is not a readable order.json ({e}). Make one with `rentplan plan --out DIR`.") \
            from None
    check_order(order, str(p))
    return order


OrderEntry = order_models(DEVICE_KINDS, PRECISIONS, OPTIMIZERS, tuple(EXTRAS), MODULE.pattern,
                          TORCH_REQUIREMENT.pattern, FORMAT)


def check_order(order, source: str) -> None:
    """order.json by its schema (planner/inputs/schema.order_models), then what joins fields: a GPU order names
    its GPU."""
    p = Problems(source)
    if not isinstance(order, dict):
        p.add("", "an order must be a JSON object (format, expect, settings, plan)")
        p.raise_if_any()
    entry = validate(OrderEntry, order, p, "")
    if entry is not None and entry.expect.device_kind in ("cuda", "rocm"):
        for key in ("gpu_id", "gpu_name", "usable_bytes"):
            if getattr(entry.expect, key) is None:
                p.add(f"expect.{key}", "missing")
    p.raise_if_any()


def order_for(campaign, result, catalog, headroom: float, offer_id: str | None) -> dict | None:
    """The order `plan` writes: for the recommended offer (None when nothing fits), an offer named by id, or
    'local' (this machine)."""
    if offer_id == "local":
        return local_order(campaign, result, headroom)
    pick = ordered(result.sheet)
    if pick is None:
        return None
    order = offer_order(campaign, pick, result.lines, catalog, headroom)
    best = recommend(result.sheet)
    order["decision"] = {"chosen_by": "you (--offer)" if offer_id else "the recommendation",
                         "recommended": None if best is None else best["offer"], "verdict": pick["verdict"],
                         "not_modelled": pick["unmodelled"] or None}
    return order
