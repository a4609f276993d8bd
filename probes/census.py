"""The work of one update, op by op: FLOPs (torch's own formulas), bytes read and written, kernel launches.

The census runs in a pass of its own, on a fresh model under fake tensors, never beside a memory
measurement: an instrument that rides along can change what it sits beside (FlopCounterMode kept the
recomputed tensors of checkpointed blocks alive). The census mode itself holds no tensor, only numbers.

One update's ops are folded into a profile: identical (kind, dtype, FLOPs, bytes) ops are counted, not
listed, so a 32-layer model gives a few hundred rows; a matmul's row also holds its output grid (matmul_grid),
which decides how many tiles and waves it runs in. The planner's time model reads the profile.
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
from torch.utils.flop_counter import conv_flop_count, flop_registry

from probes.loop import Trainer
from probes.memory import LiveTensorTracker

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


def _named(func, args, kwargs) -> dict:
    return {**{a.name: v for a, v in zip(func._schema.arguments, args)}, **kwargs}


def conv_work(func, args, kwargs, torch_flops: int) -> tuple[str, int]:
    """("conv" or "depthwise", FLOPs) of a convolution op.

    Depthwise is PyTorch's own test (aten/src/ATen/native/Convolution.cpp, ConvParams::is_depthwise: not
    transposed, 4-D or 5-D, groups == input channels > 1): such convs are not implicit GEMMs on tensor cores but
    per-channel kernels (PyTorch's DepthwiseConv2d.cu, or cuDNN's depthwise kernels for fp16 1/3/5 filters and
    channels-last: use_cudnn_depthwise), timed by the planner on the CUDA cores.
    The backward's FLOPs are counted here when groups > 1: torch.utils.flop_counter's conv_backward_flop leaves
    the groups out of the weight gradient ("I skip those for the sake of brevity"), which counts a depthwise
    conv's weight gradient C times over (352-2816 × for ConvNeXt-V2-H; fixed upstream by pytorch/pytorch#183405,
    not in torch 2.14). Each gradient costs the forward's multiply-adds: the forward's formula, whose weight
    shape (C_out, C_in / groups, k...) already holds the groups, once per gradient asked for."""
    a = _named(func, args, kwargs)
    backward = func.overloadpacket is aten.convolution_backward
    x, w, groups = a.get("input"), a.get("weight"), int(a.get("groups", 1) or 1)
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or groups <= 1:
        return "conv", torch_flops
    transposed = bool(a.get("transposed", False))
    depthwise = not transposed and x.dim() in (4, 5) and x.shape[1] == groups and w.shape[0] % x.shape[1] == 0
    kind = "depthwise" if depthwise else "conv"
    if not backward:
        return kind, torch_flops
    grad_out = a["grad_output"]
    forward = conv_flop_count(list(x.shape), list(w.shape), list(grad_out.shape), transposed=transposed)
    mask = a.get("output_mask") or [True, True, True]
    return kind, int(forward * (bool(mask[0]) + bool(mask[1])))


def channels_last(func, args, kwargs) -> bool:
    """Whether cuDNN runs this convolution in NHWC: PyTorch asks cudnn_conv_suggest_memory_format (aten/src/ATen/
    native/ConvUtils.h), which answers channels-last when the input or the weight is channels-last (and 4-D); the
    backward asks it of the same input and weight, never of grad_output."""
    a = _named(func, args, kwargs)
    for t in (a.get("input"), a.get("weight")):
        if isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous() \
                and t.is_contiguous(memory_format=torch.channels_last):
            return True
    return False


def attention_flops(func, args, kwargs, torch_flops: int) -> int:
    """An attention op's FLOPs, causal masks counted.

    torch's formulas count every query-key pair, "upper bounds for causal or otherwise masked attention"
    (torch/utils/flop_counter.py's notes); the fused kernels skip the tiles a causal mask hides: FlashAttention-2's
    causal loop stops at the diagonal (Dao, 2023, arXiv:2307.08691, section 3.1, "causal masking"), as do the
    memory-efficient kernel's (custom_mask_type 1 or 2). For a square causal mask the work is the unmasked share
    (S + 1) / 2S; a non-square one, or one given as a bias tensor (no tile is skipped), is counted in full."""
    a = _named(func, args, kwargs)
    causal = bool(a.get("is_causal", False)) or a.get("custom_mask_type", 0) in (1, 2)
    q, k = a.get("query"), a.get("key")
    if not causal or not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return torch_flops
    seq = -2 if func.overloadpacket.__name__.startswith("_scaled_dot_product") else 1  # (B, H, S, D) or (B, S, H, D)
    s_q, s_k = q.shape[seq], k.shape[seq]
    if s_q != s_k or s_k < 1:
        return torch_flops
    return int(torch_flops * (s_k + 1) / (2 * s_k))


def matmul_grid(func, args) -> list | None:
    """[batch, M, N, axis] of a matmul's output, for the planner's tile and wave count; axis says which one grows
    with the tokens of a micro-batch: "m" (rows of a row-major first operand: activations in, gradients of inputs),
    "b" (a bmm's batch) or "-" (neither: a weight gradient, whose first operand is a transposed activation)."""
    a, b = (args[1], args[2]) if func.overloadpacket in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    if (not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() != b.dim()
            or a.dim() not in (2, 3)):
        return None
    if a.dim() == 3:
        return [int(a.shape[0]), int(a.shape[1]), int(b.shape[2]), "b"]
    row_major = a.shape[1] <= 1 or a.stride(1) == 1
    return [1, int(a.shape[0]), int(b.shape[1]), "m" if row_major else "-"]


RNN_LAYER, RNN_LAYER_BACKWARD = aten.mkldnn_rnn_layer.default, aten.mkldnn_rnn_layer_backward.default


def rnn_matmuls(func, args, kwargs, dtype: str) -> list[tuple]:
    """The gate GEMMs of one recurrent layer in one direction (nn.LSTM on the CPU is one oneDNN op per layer, for
    which torch has no FLOP formula), as cuDNN's RNN runs them: the input projection as one GEMM over every step,
    the recurrent projection one step at a time (each step needs the last one's state); in backward the input
    gradient and both weight gradients as GEMMs over every step, the state's gradient step by step. Rows of
    (kind, dtype, flops, bytes, count, grid); a step's grid has axis "r": its M is the micro-batch and its
    count the steps, so the planner scales the two apart (planner/models/roofline.scale_rows)."""
    a = _named(func, args, kwargs)
    x, w_ih, w_hh, hx = a["input"], a["weight0" if func is RNN_LAYER else "weight1"], \
        a["weight1" if func is RNN_LAYER else "weight2"], a["hx_"]
    batch = int(hx.shape[0]) if hx.dim() == 2 else int(x.shape[1])
    steps = int(x.shape[0] if int(x.shape[1]) == batch else x.shape[1])
    gates, width, hidden = int(w_ih.shape[0]), int(w_ih.shape[1]), int(w_hh.shape[1])  # (G·H, I), (G·H, H)
    size, tokens = x.element_size(), steps * batch

    def gemm(m, n, k, count, axis):
        return ("matmul", dtype, 2 * m * n * k, (m * k + k * n + m * n) * size, count, (1, m, n, axis))

    if func is RNN_LAYER:
        return [gemm(tokens, gates, width, 1, "m"),  # x · W_ih for every step at once
                gemm(batch, gates, hidden, steps, "r")]  # h_{t-1} · W_hh, step by step
    return [gemm(batch, hidden, gates, steps, "r"),  # dh_{t-1} = dgates_t · W_hh, step by step
            gemm(tokens, width, gates, 1, "m"),  # dx = dgates · W_ih
            gemm(gates, width, tokens, 1, "-"),  # dW_ih = dgatesᵀ · x
            gemm(gates, hidden, tokens, 1, "-")]  # dW_hh = dgatesᵀ · h


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
        self.conv_flops: Counter = Counter()  # a convolution's FLOPs by the layout cuDNN runs it in

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
        if kind == "conv":
            kind, flops = conv_work(func, args, kwargs, flops)
            if kind == "conv":
                self.conv_flops["channels_last" if channels_last(func, args, kwargs) else "contiguous"] += flops
        elif kind == "attention" and flops:
            flops = attention_flops(func, args, kwargs, flops)
        moved = sum(_bytes(t) for t in ins) + sum(_bytes(t) for t in outs)
        ref = next((t for t in ins + outs if t.is_floating_point()), None)
        dtype = str(ref.dtype).replace("torch.", "") if ref is not None else "other"
        grid = tuple(matmul_grid(func, args) or ()) if kind == "matmul" else ()
        if func is RNN_LAYER or func is RNN_LAYER_BACKWARD:  # its GEMMs, besides the op's own traffic below
            for k, d, f, b, n, g in rnn_matmuls(func, args, kwargs, dtype):
                self.rows[(k, d, f, b, g)] += n
                self.launches += n
        self.rows[(kind, dtype, flops, moved, grid)] += 1
        self.launches += -(-len(ins) // FOREACH_TENSORS_PER_LAUNCH) if kind == "foreach" else 1
        return out

    def profile(self) -> dict:
        rows = sorted(([k, d, f, b, n] + ([list(g)] if g else []) for (k, d, f, b, g), n in self.rows.items()),
                      key=lambda r: (r[0], r[1], -r[2], -r[3]))
        out = {"ops": rows, "launches": self.launches,
               "flops": sum(r[2] * r[4] for r in rows), "bytes": sum(r[3] * r[4] for r in rows)}
        if sum(self.conv_flops.values()):  # the layout most of the convolutions' work ran in, which the planner
            out["conv_memory_format"] = max(("contiguous", "channels_last"), key=lambda f: self.conv_flops[f])
        return out  # times them by (planner/models/roofline.conv_fraction)


def _resolved(leaf: str) -> str:
    """An fp32_precision setting as PyTorch resolves it: "none" inherits the global torch.backends.fp32_precision."""
    return leaf if leaf != "none" else torch.backends.fp32_precision


def precision_flags() -> dict:
    """What decides the fp32 peak on a GPU: matmuls' precision ("highest": no TF32) and cuDNN's TF32 switch, and
    whether cuDNN autotunes its convolution algorithms. The legacy getters answer while the legacy API is in force
    (allow_tf32, set_float32_matmul_precision: the fp32_precision getters then read "none"); once a workload used the
    fp32_precision API (torch >= 2.9) they raise ("mix of the legacy and new APIs") and its getters answer."""
    try:
        matmul = torch.get_float32_matmul_precision()
    except RuntimeError:
        matmul = {"tf32": "high", "bf16": "medium"}.get(_resolved(torch.backends.cuda.matmul.fp32_precision), "highest")
    try:
        conv_tf32 = bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        conv_tf32 = _resolved(torch.backends.cudnn.conv.fp32_precision) == "tf32"
    return {"float32_matmul_precision": matmul, "cudnn_allow_tf32": conv_tf32,
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}  # autotuned convolution algorithms


def census(workload, cfg, kernels=contextlib.nullcontext) -> dict:
    """A steady update (every micro-batch of the window and the optimizer step; the second update of a fresh
    model, so that the optimizer's state already exists) under fake tensors.
    The process's RNG is saved and restored: the real run that follows sees the same random numbers."""
    from probes.fake import EstimateFakeMode

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
