"""Time model: seconds per update on a catalog GPU, a point estimate within a range, with its basis named.

- Measured on a CUDA GPU found in the catalog: the measured update time, moved to the planned shape and to
  the target GPU by the ratio of the per-op roofline model (planner/models/roofline.py) between them, evaluated with
  the fast, point and slow fractions (the range spans the three ratios).
- Otherwise (CPU pilot or estimate), with a census of the update's ops: the per-op roofline model itself,
  with the target GPU's kernels (fast end, point, slow end).
- Lines without a census (older ledgers): FLOPs ÷ (target peak × 25–50 % MFU), never under a kernel-launch
  floor of (ops per update × 5–10 µs), and the basis says so.
- Data parallel over n GPUs: per-GPU compute / n, plus the collectives of the strategy, timed as ring
  collectives over the catalog's links plus NCCL's own per-collective and per-step latency (estimates, named
  as such): DDP all-reduces the gradients once
  per update (accumulation runs under no_sync); FSDP all-gathers the parameters for forward and again for
  backward and reduce-scatters the gradients on every micro-batch. Within an instance the link is NVLink
  (GB/s), else PCIe; across nodes (multi-node offers only) the node's network, shared by its GPUs. The low
  end assumes communication fully overlapped with compute, the high end none.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pandas as pd

from planner.catalog_records import Catalog, Gpu, Offer
from planner.models.kernels import kernel_target
from planner.models.roofline import FAST, POINT, SLOW, census_for
from planner.units import fmt_seconds

MFU_RANGE = (0.25, 0.50)
LAUNCH_S = (5e-6, 10e-6)
PCIE_GBPS = {"gen5": 64.0, "gen4": 32.0, "gen3": 16.0}  # GB/s one direction, x16 (nominal)


@dataclass(frozen=True)
class TimeRange:
    low_s: float
    high_s: float
    basis: str
    point_s: float | None = None  # the point estimate (inside the range), where the model gives one


@dataclass(frozen=True)
class Throughput:
    """What the pilot observed for one configuration family, reduced to per-token figures."""

    flops_per_token: float  # training (forward + backward) FLOPs per token
    ops_per_micro_batch: float | None
    measured_s_per_token: float | None  # from the steady median on the pilot device
    device: str
    device_name: str
    grad_bytes: int  # gradient bytes (trainable parameters, their dtype) all-reduced per update under DDP
    param_bytes: int  # parameter bytes all-gathered per pass under FSDP
    micro_batch: int
    seq_len: int
    grad_accum: int
    op_profile_json: str | None = None  # the census per kernel target (steady line)

    def census(self, target: str):
        return census_for(self.op_profile_json, target, self.micro_batch, self.seq_len, self.grad_accum)


def throughput(ev) -> Throughput | None:
    """Per-token work of the chosen run nearest the campaign's shape that has a steady line (planner/evidence)."""
    facts = ev.facts
    timed = facts[facts["flops_per_update"].notna() | facts["update_s"].notna()]
    if timed.empty:
        return None
    row = timed.iloc[0]
    tokens = int(row["micro_batch"]) * int(row["seq_len"]) * int(row["grad_accum"])
    flops, ops = row["flops_per_update"], row["ops_per_update"]
    measured = row["mode"] == "measured" and pd.notna(row["update_s"])
    grads = 0 if pd.isna(row["grad_bytes"]) else int(row["grad_bytes"])
    return Throughput(
        flops_per_token=float(flops) / tokens if pd.notna(flops) else 0.0,
        ops_per_micro_batch=None if pd.isna(ops) else float(ops) / int(row["grad_accum"]),
        measured_s_per_token=float(row["update_s"]) / tokens if measured else None,
        device=str(row["device"]), device_name=str(row["device_name"] or ""), grad_bytes=grads,
        param_bytes=int(row["param_bytes"]) if pd.notna(row["param_bytes"]) else grads,
        micro_batch=int(row["micro_batch"]), seq_len=int(row["seq_len"]), grad_accum=int(row["grad_accum"]),
        op_profile_json=row["op_profile_json"] if isinstance(row["op_profile_json"], str) else None)


def match_catalog_gpu(device_name: str, catalog: Catalog) -> Gpu | None:
    """'NVIDIA H100 80GB HBM3' -> the catalog GPU sharing the most name tokens (model number must match)."""
    tokens = set(re.findall(r"[a-z0-9]+", device_name.lower())) - {"nvidia", "amd", "gb", "instinct", "geforce"}
    model_tokens = {t for t in tokens if re.search(r"\d", t) and re.search(r"[a-z]", t)}
    best, score = None, 0
    for g in catalog.gpus.values():
        gt = set(re.findall(r"[a-z0-9]+", g.name.lower()))
        if model_tokens and not model_tokens & gt:
            continue
        s = len(tokens & gt)
        if s > score:
            best, score = g, s
    return best


def _interconnect_gbps(gpu: Gpu) -> float:
    if gpu.nvlink_gbps:
        return gpu.nvlink_gbps / 2  # catalog figure is bidirectional
    text = (gpu.interconnect or "").lower()
    for gen, bw in PCIE_GBPS.items():
        if gen in text.replace(" ", ""):
            return bw
    return PCIE_GBPS["gen3"]


@dataclass(frozen=True)
class Comm:
    seconds: float
    basis: str


def comm_time(tp: Throughput, strategy: str, gpu: Gpu, offer: Offer, grad_accum: int) -> Comm:
    """Seconds of collectives per update for `strategy` over all of the offer's GPUs (an estimate).

    Ring collectives: all-reduce moves 2(n-1)/n of the bytes per GPU, all-gather and reduce-scatter (n-1)/n
    each. Across nodes the hierarchical form applies: within a node over its links, then between nodes, where
    each node's network carries 2(m-1)/m (all-reduce) or (m-1)/m of the bytes for its m nodes."""
    g, m = offer.gpus_per_instance, offer.nodes
    if strategy == "ddp":
        volume, factor, what = tp.grad_bytes, 2.0, "all-reduce of the gradients once per update"
    elif strategy == "fsdp":
        # forward all-gather + backward all-gather of parameters, reduce-scatter of gradients, per micro-batch
        volume, factor = grad_accum * (2 * tp.param_bytes + tp.grad_bytes), 1.0
        what = f"all-gather ×2 + reduce-scatter per micro-batch (× {grad_accum})"
    else:
        return Comm(0.0, "")
    intra = factor * (g - 1) / g * volume / (_interconnect_gbps(gpu) * 1e9) if g > 1 else 0.0
    inter = factor * (m - 1) / m * volume / ((offer.network_gbps or 0.0) / 8) / 1e9 if m > 1 else 0.0
    if strategy == "ddp":
        calls, steps = _ddp_buckets(tp.grad_bytes), 2
    else:
        calls, steps = 3 * grad_accum, 1  # at least one FSDP unit: its three collectives per micro-batch
    latency = calls * _ring_latency_s(g * m, m, steps, nvlink=bool(gpu.nvlink_gbps))
    seconds = intra + inter + latency
    link = gpu.interconnect or "PCIe"
    where = f"{link}" + (f" + {offer.network} {offer.network_gbps:g} Gb/s between {m} nodes" if m > 1 else "")
    return Comm(seconds, f"{what}: {fmt_seconds(seconds)} over {where} (estimated; {calls} collectives × "
                         f"{fmt_seconds(latency / calls)} of NCCL ring latency)")


# NCCL's own cost model for ring collectives, Simple protocol (src/graph/tuning.cc, ncclTopoTuneModel): a base
# latency of 8.4 µs per collective plus a latency per ring step of 3.4 µs over NVLink, 5.7 µs over PCI and
# 9.6 µs over the network; an all-reduce takes 2(n-1) steps, all-gather and reduce-scatter n-1.
NCCL_BASE_US = 8.4
NCCL_STEP_US = {"nvlink": 3.4, "pci": 5.7, "net": 9.6}
# DDP's gradient buckets (torch/nn/parallel/distributed.py): the first 1 MiB, the rest 25 MiB each.
DDP_FIRST_BUCKET, DDP_BUCKET = 2**20, 25 * 2**20


def _ddp_buckets(grad_bytes: float) -> int:
    rest = max(0.0, grad_bytes - DDP_FIRST_BUCKET)
    return 1 + math.ceil(rest / DDP_BUCKET)


def _ring_latency_s(ranks: int, nodes: int, steps_per_rank: int, nvlink: bool) -> float:
    inter = steps_per_rank * (nodes - 1)
    intra = steps_per_rank * (ranks - 1) - inter
    us = NCCL_BASE_US + intra * NCCL_STEP_US["nvlink" if nvlink else "pci"] + inter * NCCL_STEP_US["net"]
    return us * 1e-6


def update_time(tp: Throughput, gpu: Gpu, precision: str, micro_batch: int, seq_len: int, grad_accum: int,
                replicas: int, catalog: Catalog, strategy: str, offer: Offer) -> TimeRange:
    """Seconds per optimizer update on `gpu` for the planned configuration (per-GPU compute + collectives).
    micro_batch and grad_accum are per GPU; the replicas share the effective batch."""
    census = tp.census(kernel_target(gpu.compute_capability, gpu.software))
    census = census.for_precision(precision) if census is not None else None
    if census is not None and census.missing_peak(gpu):
        return TimeRange(float("nan"), float("nan"), f"no time: the catalog lists no {census.missing_peak(gpu)} "
                                                     f"peak for {gpu.id}, which this update's matmuls need")
    src = match_catalog_gpu(tp.device_name, catalog) if tp.device.startswith("cuda") else None
    point = None
    if src is not None and tp.measured_s_per_token is not None and census is not None:
        measured = tp.measured_s_per_token * tp.micro_batch * tp.seq_len * tp.grad_accum
        at_shape = measured * (census.seconds(src, micro_batch, seq_len, grad_accum, POINT)
                               / census.seconds(src, tp.micro_batch, tp.seq_len, tp.grad_accum, POINT))
        ratios = [census.seconds(gpu, micro_batch, seq_len, grad_accum, fr)
                  / census.seconds(src, micro_batch, seq_len, grad_accum, fr) for fr in (FAST, POINT, SLOW)]
        lo, point, hi = at_shape * min(ratios), at_shape * ratios[1], at_shape * max(ratios)
        basis = (f"measured on {tp.device_name} ({measured * 1e3:.1f} ms at micro-batch {tp.micro_batch} × seq "
                 f"{tp.seq_len}), moved to this shape and to {gpu.id} by the per-op roofline's ratio "
                 f"({min(ratios):.2f}–{max(ratios):.2f}×)")
    elif src is not None and tp.measured_s_per_token is not None and (src_peak := src.peak_tflops(precision)) and \
            (gpu_peak := gpu.peak_tflops(precision)):
        t_src = tp.measured_s_per_token * micro_batch * seq_len * grad_accum
        r_compute = src_peak / gpu_peak
        r_memory = src.mem_bandwidth_tbps / gpu.mem_bandwidth_tbps
        lo, hi = sorted((t_src * r_compute, t_src * r_memory))
        basis = (f"measured on {tp.device_name}, scaled by TFLOPS ({r_compute:.2f}×) and bandwidth "
                 f"({r_memory:.2f}×) ratios (no op census on these lines)")
    elif census is not None:
        lo, point, hi = (census.seconds(gpu, micro_batch, seq_len, grad_accum, fr) for fr in (FAST, POINT, SLOW))
        basis = f"{census.describe(gpu, precision)}; census from the {tp.device} pilot"
    else:
        flops = tp.flops_per_token * micro_batch * seq_len * grad_accum
        peak = gpu.peak_tflops(precision)
        if not peak or flops <= 0:
            return TimeRange(float("nan"), float("nan"), f"no {precision} peak for {gpu.id} in the catalog")
        lo, hi = flops / (peak * 1e12 * MFU_RANGE[1]), flops / (peak * 1e12 * MFU_RANGE[0])
        basis = (f"FLOPs counted on the {tp.device} pilot ÷ ({gpu.id} {precision} peak {peak:g} TFLOPS × "
                 f"{MFU_RANGE[0]:.0%}–{MFU_RANGE[1]:.0%}) (lines without an op census)")
        if tp.ops_per_micro_batch:
            ops = tp.ops_per_micro_batch * grad_accum
            floor_lo, floor_hi = ops * LAUNCH_S[0], ops * LAUNCH_S[1]
            if floor_lo > lo or floor_hi > hi:
                basis += f"; kernel-launch floor {ops:.0f} ops × 5–10 µs"
            lo, hi = max(lo, floor_lo), max(hi, floor_hi)
    if replicas > 1:
        comm = comm_time(tp, strategy, gpu, offer, grad_accum)
        lo, hi = max(lo, comm.seconds), hi + comm.seconds
        point = None if point is None else point + comm.seconds / 2
        basis += f"; {comm.basis}; fast end fully overlapped with compute, point half, slow end not at all"
    return TimeRange(lo, hi, basis, point)
