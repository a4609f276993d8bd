"""Estimates run the kernels the target GPU runs, on the CPU build of torch, under fake tensors.

Three differences between the CPU build's kernels and a CUDA GPU's change what a training step keeps:
1. Attention. CUDA runs flash or memory-efficient attention (planner/models/kernels.py has the rule); they save
   the output, its logsumexp and the RNG state. In training with dropout the CPU build falls back to the
   math path, which saves the S × S attention and its dropout mask. Here aten::scaled_dot_product_attention
   (a Python kernel at its CompositeImplicitAutograd key, see CudaKernels) takes the kernel CUDA would:
   aten._scaled_dot_product_flash_attention / _efficient_attention, whose fake implementations run on CPU
   tensors and return exactly what the CUDA kernels return, or CUDA's math fallback,
   aten._scaled_dot_product_attention_math, where neither applies. The composite's preparation is kept:
   bool masks become an additive mask of the query's dtype, unaligned masks are padded to 8, head dims are
   padded to 8 for flash (aten/src/ATen/native/transformers/cuda/attention.cu: convert_boolean_attn_mask,
   preprocess_mask, pad_last_dim).
2. Dropout. Out of place in training, CUDA runs the fused native_dropout, which saves a 1-byte mask; the
   CPU build multiplies by a noise tensor of the input's dtype and saves that (aten/src/ATen/native/
   Dropout.cpp: dropout() takes native_dropout only when is_fused_kernel_acceptable, which needs CUDA).
3. Autocast. The CUDA policy (the AT_FORALL_* lists of ATen/autocast_mode.h: layer_norm, softmax, sum,
   exp ... in fp32; einsum, mv ... in lower precision) differs from the CPU policy (autocast_mode.cpp,
   TORCH_LIBRARY_IMPL(aten, AutocastCPU)). `cuda_autocast_policy` registers Python kernels at the
   AutocastCPU key, for the ops where the two differ, so CPU autocast behaves as CUDA's does; it removes
   them on exit. The lists are checked against this torch's own AutocastCUDA registrations in the tests.

Not modelled, and why: cuDNN convolution workspaces (PyTorch retries with a smaller workspace when one does
not fit: they use free memory, they never cause an OOM); fused AdamW (the loop runs foreach AdamW, whose
_foreach ops allocate the same on both builds); in-place dropout (dropout_, not fused on CUDA either).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.nn.functional as F

from planner.models.kernels import REPRESENTATIVE_SM, attention_backend

aten = torch.ops.aten

# ATen/autocast_mode.h (the lists CUDA registers, TORCH_LIBRARY_IMPL(aten, Autocast) in autocast_mode.cpp)
CUDA_LOWER = ["_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
              "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu",
              "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm",
              "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
              "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
              "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
              "cudnn_convolution", "cudnn_convolution_transpose"]
CUDA_FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
             "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
             "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm",
             "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
             "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss",
             "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss",
             "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist",
             "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
             "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
             "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
             "upsample_bicubic2d", "_upsample_bicubic2d_aa"]
CUDA_FP32_SET_OPT_DTYPE = ["prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                           "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                           "sum.dim_IntList"]
CUDA_PROMOTE = ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
                "tensordot", "scatter_add"]
CUDA_OTHER = ["binary_cross_entropy", "norm.Scalar", "norm.ScalarOpt_dim"]  # banned; fp32_append_dtype


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    return obj


def _redispatch(op, args, kwargs):
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    with torch._C._ExcludeDispatchKeyGuard(keys):
        return op(*args, **kwargs)


def _kernel(op, policy: str):
    names = [a.name for a in op._schema.arguments]
    dtype_at = names.index("dtype") if "dtype" in names else len(names)

    def cast_to(dtype):
        return lambda t: t.to(dtype) if _eligible(t) and t.dtype != dtype else t

    def kernel(*args, **kwargs):
        if policy == "lower":
            fn = cast_to(torch.get_autocast_dtype("cpu"))
        elif policy == "fp32":
            fn = cast_to(torch.float32)
        elif policy == "promote":
            flat = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else [a])]
            dtypes = [t.dtype for t in flat if _eligible(t)]
            widest = max(dtypes, key=lambda d: torch.finfo(d).bits, default=None)
            fn = cast_to(widest) if widest is not None else (lambda t: t)
        elif policy == "set_opt_dtype":  # fp32 output when the first argument is a floating tensor
            if _eligible(args[0]):
                if dtype_at < len(args):
                    if args[dtype_at] is None:
                        args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1:])
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            fn = lambda t: t  # noqa: E731
        else:
            raise AssertionError(policy)
        return _redispatch(op, _map_tensors(args, fn), {k: _map_tensors(v, fn) for k, v in kwargs.items()})

    return kernel


def _banned(*args, **kwargs):
    raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
                       "(as on CUDA): use binary_cross_entropy_with_logits")


def _op(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(aten, base, None)
    return None if packet is None else getattr(packet, overload or "default", None)


@contextlib.contextmanager
def cuda_autocast_policy():
    """While active, torch.autocast('cpu', dtype) casts as torch.autocast('cuda', dtype) would."""
    cpu_has = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
    cpu_lower = {f"aten::{n}" for n in CUDA_LOWER}
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        for names, policy in ((CUDA_LOWER, "lower"), (CUDA_FP32, "fp32"), (CUDA_FP32_SET_OPT_DTYPE, "set_opt_dtype"),
                              (CUDA_PROMOTE, "promote")):
            for name in names:
                op = _op(name)
                if op is None or (policy == "lower" and f"aten::{name}" in cpu_has):
                    continue  # CPU's own kernel already casts the same way (and keeps the weight-cast cache)
                lib.impl(name, _kernel(op, policy), "AutocastCPU")
        lib.impl("binary_cross_entropy", _banned, "AutocastCPU")
        for full in cpu_has:  # CPU-only policies (cross_entropy_loss, cat, stack, fft ...): CUDA has none
            name = full.split("::", 1)[1]
            if full not in cpu_lower and name not in CUDA_FP32 + CUDA_FP32_SET_OPT_DTYPE + CUDA_PROMOTE + CUDA_OTHER:
                lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


class CudaKernels:
    """Routes attention and dropout to the kernels a CUDA GPU of the target runs (see the module docstring).

    The routing is a Python kernel for aten::scaled_dot_product_attention and aten::dropout at the
    CompositeImplicitAutograd key (where the CPU build decides between its kernels), registered while the
    target's kernels are active. At the dispatcher it holds wherever the op is called from: a backward that
    recomputes checkpointed blocks, a model that calls torch.ops.aten directly. (A TorchFunctionMode did not:
    it is set aside while it handles Tensor.backward, so checkpointed blocks recomputed with the CPU build's
    kernels.)"""

    def __init__(self, target: str):
        self.target = target
        self.sm = REPRESENTATIVE_SM[target]
        self.backends: dict[str, int] = {}  # what attention ran, for the line's detail

    def dropout(self, input, p, train):
        if train and 0 < p < 1 and input.numel() > 0:
            return aten.native_dropout(input, p, True)[0]  # saves a bool mask, as CUDA's fused kernel does
        if not train or p == 0 or input.numel() == 0:
            return input  # as aten/src/ATen/native/Dropout.cpp's _dropout
        return input.mul(torch.zeros((), dtype=input.dtype))  # p == 1

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                  enable_gqa=False):
        if torch.is_autocast_enabled("cpu"):  # sdpa is on CUDA's lower-precision list
            low = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(low) if t.dtype == torch.float32 else t for t in (query, key, value))
        if enable_gqa and key.size(-3) != query.size(-3):
            n = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(n, dim=-3), value.repeat_interleave(n, dim=-3)
        training = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        contiguous = all(t.stride(-1) == 1 for t in (query, key, value))
        backend = attention_backend(self.sm, str(query.dtype).replace("torch.", ""), query.size(-1),
                                    value.size(-1), attn_mask is not None, dropout_p, is_causal,
                                    query.size(-2), key.size(-2), training, contiguous)
        self.backends[backend] = self.backends.get(backend, 0) + 1
        scale = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
        if backend == "flash":
            d = query.size(-1)
            pad = (-d) % 8
            q, k, v = (F.pad(t, (0, pad)) if pad else t for t in (query, key, value))
            out = aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
            return out[..., :d] if pad else out
        if backend == "efficient":
            bias = attn_mask
            if bias is not None:
                if bias.dtype == torch.bool:
                    bias = torch.zeros_like(bias, dtype=query.dtype).masked_fill_(bias.logical_not(), -math.inf)
                aligned = all(s % 8 == 0 for s in bias.stride()[:-1]) and bias.stride(-1) == 1
                if not aligned:
                    last = bias.size(-1)
                    bias = F.pad(bias, (0, 8 - last % 8))[..., :last]
                bias = bias.expand(query.size(0), query.size(1), query.size(2), key.size(2))
            return aten._scaled_dot_product_efficient_attention(query, key, value, bias, training, dropout_p,
                                                                is_causal, scale=scale)[0]
        # CUDA's math fallback (sdp_utils: SDPBackend::math); its dropout is aten::dropout, routed above
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                       scale=scale)[0]


@contextlib.contextmanager
def target_kernels(target: str | None):
    """The kernels of `target` ('sm80+', 'sm50-75'); 'cpu', '' or None: the CPU build's own."""
    if not target or target == "cpu":
        yield None
        return
    if target not in REPRESENTATIVE_SM:
        raise ValueError(f"unknown kernel target {target!r}: one of {', '.join(REPRESENTATIVE_SM)}, cpu")
    kernels = CudaKernels(target)
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
        lib.impl("scaled_dot_product_attention", kernels.attention, "CompositeImplicitAutograd")
        lib.impl("dropout", kernels.dropout, "CompositeImplicitAutograd")
    try:
        with cuda_autocast_policy():
            yield kernels
    finally:
        lib._destroy()
