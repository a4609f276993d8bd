"""The work of one update, op by op: FLOPs (torch's own formulas), bytes read and written, kernel launches.

The census runs in a pass of its own, on a fresh model under fake tensors, never beside a memory
measurement: an instrument that rides along can change what it sits beside (FlopCounterMode kept the
recomputed tensors of checkpointed blocks alive). The census mode itself holds no tensor, only numbers.

One update's ops are folded into a profile: identical (kind, dtype, FLOPs, bytes) ops are counted, not
listed, so a 32-layer model gives a few hundred rows. The planner's time model reads the profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
_DEVICE = torch.ops.prim.device.default
MATMUL = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
# Convolutions apart: cuDNN runs fp32 convolutions on TF32 tensor cores by default (torch.backends.cudnn.allow_tf32
# is True; matmuls' torch.backends.cuda.matmul.allow_tf32 is False), so their fp32 peak differs.
CONV = {aten.convolution, aten._convolution, aten.convolution_backward, aten.cudnn_convolution,
        aten._slow_conv2d_forward}
ATTENTION = {aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward,
             aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_efficient_attention_backward,
             aten._flash_attention_forward, aten._flash_attention_backward, aten._efficient_attention_forward,
             aten._efficient_attention_backward, aten._scaled_dot_product_cudnn_attention,
             aten._scaled_dot_product_cudnn_attention_backward}
# Ops that only describe tensors (views, metadata) launch no kernel. OpOverload.is_view covers most.
NO_KERNEL = {aten.detach, aten.alias, aten.lift_fresh, aten.empty, aten.empty_strided, aten.empty_like,
             aten._local_scalar_dense, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.is_same_size,
             aten._has_compatible_shallow_copy_type, aten.set_, aten.resize_, aten.t, aten.lift}
FOREACH_TENSORS_PER_LAUNCH = 48  # multi_tensor_apply packs up to 36–110 tensors per launch (by list depth)


def _bytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def kind_of(func) -> str | None:
    if func.namespace in ("prim", "profiler"):
        return None
    packet = func.overloadpacket
    if packet in MATMUL:
        return "matmul"
    if packet in CONV:
        return "conv"
    if packet in ATTENTION:
        return "attention"
    if packet in NO_KERNEL or getattr(func, "is_view", False):
        return None
    if packet.__name__.startswith("_foreach_"):
        return "foreach"
    return "memory"


class OpCensus(TorchDispatchMode):
    """Counts (kind, dtype, flops, bytes) per op; launches separately (foreach ops launch several)."""

    def __init__(self):
        super().__init__()
        self.rows: Counter = Counter()
        self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is FakeTensor:  # `.device`: no kernel, asked per tensor
            return args[0].fake_device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = kind_of(func)
        if kind is None:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs and not func._schema.is_mutable:  # prim.device, profiler records: no kernel
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        flops = 0
        if func.overloadpacket in flop_registry:
            flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        moved = sum(_bytes(t) for t in ins) + sum(_bytes(t) for t in outs)
        ref = next((t for t in ins + outs if t.is_floating_point()), None)
        dtype = str(ref.dtype).replace("torch.", "") if ref is not None else "other"
        self.rows[(kind, dtype, flops, moved)] += 1
        self.launches += -(-len(ins) // FOREACH_TENSORS_PER_LAUNCH) if kind == "foreach" else 1
        return out

    def profile(self) -> dict:
        rows = sorted(([k, d, f, b, n] for (k, d, f, b), n in self.rows.items()), key=lambda r: (r[0], r[1], -r[2]))
        return {"ops": rows, "launches": self.launches,
                "flops": sum(r[2] * r[4] for r in rows), "bytes": sum(r[3] * r[4] for r in rows)}


def precision_flags() -> dict:
    """What decides the fp32 peak on a GPU: matmuls' precision ("highest": no TF32) and cuDNN's TF32 switch."""
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def census(workload, cfg, kernels=contextlib.nullcontext) -> dict:
    """A steady update (every micro-batch of the window and the optimizer step; the second update of a fresh
    model, so that the optimizer's state already exists) under fake tensors.
    The process's RNG is saved and restored: the real run that follows sees the same random numbers."""
    from probes.fake import EstimateFakeMode
    from probes.loop import Trainer

    from probes.memory import LiveTensorTracker

    # Per rank, the compute of DDP and FSDP is that of one process (collectives are timed by the planner).
    one = dataclasses.replace(cfg, strategy="single", world_size=1)
    # The run's cap holds here too, on the fake bytes: a loss that allocates until something stops it would
    # otherwise run on, unstopped, until the worker's timeout, while the real update after it stops at the cap.
    guard = LiveTensorTracker(cfg.cap_bytes) if cfg.cap_bytes else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), EstimateFakeMode(), kernels(), guard:
        trainer = Trainer(workload, one, torch.device("cpu"), fake=True)
        trainer.train_update()  # the first update also creates the optimizer state: steady updates do not
        counter = OpCensus()
        with counter:
            trainer.train_update()
        out = counter.profile()
    out.update(precision_flags())
    return out


def census_fields(profiles: dict[str, dict]) -> dict:
    """Line fields from census profiles per kernel target (the first one's totals go in the columns)."""
    if not profiles:
        return {}
    first = next(iter(profiles.values()))
    if "error" in first:
        return {"op_profile_json": json.dumps(profiles)}
    return {"flops_per_update": float(first["flops"]), "ops_per_update": int(first["launches"]),
            "op_profile_json": json.dumps(profiles, separators=(",", ":"))}
