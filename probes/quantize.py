"""Quantized base weights (QLoRA): the model's linear layers become bitsandbytes 4-bit (nf4, fp4) or 8-bit layers,
LoRA trains on top (probes/hf.py), everything else of the base stays in bf16, the compute dtype.

Measured runs quantize for real: `Params4bit(weight).to(device)` packs two 4-bit values per byte with a
float32 absmax per block of 64, itself quantized to 8 bits in blocks of 256 (bitsandbytes' default double
quantization, `compress_statistics=True`); `Int8Params` keeps int8 rows with a float32 scale per row.

Estimates cannot wrap a fake tensor in bitsandbytes' parameter classes (a tensor subclass of a tensor
subclass), so they build the same layer with the same tensors: bitsandbytes quantizes a weight on the meta
device (its ops' fake implementations serve as meta kernels), then the packed weight and every tensor of its
quant state are made under the estimate's fake mode, where the tracker counts them. The layer is
bitsandbytes' own `Linear4bit` (forward, MatMul4Bit's backward, peft's LoRA wrapper all unchanged); only its
weight is a plain parameter carrying `quant_state`. tests/test_qlora.py checks the estimate against a
measured run, tensor for tensor.
"""

from __future__ import annotations

import copy

import torch

QUANTIZE = ("nf4", "fp4", "int8")
COMPUTE_DTYPE = torch.bfloat16
SKIP = ("lm_head", "score", "classifier")  # output heads stay in the compute dtype, as transformers' bnb loading


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise RuntimeError("quantize needs bitsandbytes: pip install 'rentplan[quant]'") from None
    return bnb


def targets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, linear) for every linear layer to quantize."""
    out = []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear and name not in SKIP:
                out.append((parent, name, child))
    return out


def weights_to_quantize(model: torch.nn.Module) -> set[int]:
    """ids of the weights quantize() replaces: estimates leave them on meta (never materialised unquantized)."""
    return {id(lin.weight) for _, _, lin in targets(model)}


def quantize(model: torch.nn.Module, kind: str, device: torch.device, fake: bool) -> torch.nn.Module:
    """Replace the target linears one at a time (only one unquantized weight exists at any moment)."""
    if kind not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {kind!r}")
    for parent, name, lin in targets(model):
        new = (_fake_layer if fake else _real_layer)(lin, kind, device)
        setattr(parent, name, new)
        del lin
    return model


def _layer(lin: torch.nn.Linear, kind: str):
    bnb = _bnb()
    bias = lin.bias is not None
    if kind == "int8":
        return bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=bias, has_fp16_weights=False,
                                   threshold=0.0, device="meta")
    return bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=bias, compute_dtype=COMPUTE_DTYPE,
                             quant_type=kind, compress_statistics=True, quant_storage=torch.uint8, device="meta")


def _real_layer(lin: torch.nn.Linear, kind: str, device: torch.device):
    bnb = _bnb()
    new = _layer(lin, kind)
    data = lin.weight.data.to(COMPUTE_DTYPE)
    if kind == "int8":
        new.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
    else:
        new.weight = bnb.nn.Params4bit(data, requires_grad=False, quant_type=kind, compress_statistics=True,
                                       quant_storage=torch.uint8)
    if lin.bias is not None:
        new.bias = torch.nn.Parameter(lin.bias.data.to(COMPUTE_DTYPE), requires_grad=False)
    return new.to(device)  # bitsandbytes quantizes as the weight moves to its device


def _fake_layer(lin: torch.nn.Linear, kind: str, device: torch.device):
    bnb = _bnb()
    from torch.utils._python_dispatch import _disable_current_modes

    if kind == "int8":  # Int8Params after quantization: int8 rows (CB, which is the weight) and a scale per row
        with _disable_current_modes():
            meta = torch.empty(lin.out_features, lin.in_features, dtype=COMPUTE_DTYPE, device="meta")
            cb, scb, _ = bnb.functional.int8_vectorwise_quant(meta)
            new = _layer(lin, kind)
        weight = torch.nn.Parameter(torch.empty_like(cb, device=device), requires_grad=False)
        weight.CB, weight.SCB, weight.has_fp16_weights = weight.data, torch.empty_like(scb, device=device), False
        new.weight = weight
        if lin.bias is not None:
            new.bias = torch.nn.Parameter(torch.empty(lin.out_features, dtype=COMPUTE_DTYPE, device=device),
                                          requires_grad=False)
        return new

    with _disable_current_modes():  # on meta, outside the estimate's modes: shapes only
        meta = torch.empty(lin.out_features, lin.in_features, dtype=COMPUTE_DTYPE, device="meta")
        packed, state = bnb.functional.quantize_4bit(meta, blocksize=64, compress_statistics=True,
                                                     quant_type=kind, quant_storage=torch.uint8)
        new = _layer(lin, kind)
    weight = torch.nn.Parameter(torch.empty_like(packed, device=device), requires_grad=False)
    weight.quant_state = _materialised(state, device)
    weight.bnb_quantized = True
    new.weight = weight
    if lin.bias is not None:
        new.bias = torch.nn.Parameter(torch.empty(lin.out_features, dtype=COMPUTE_DTYPE, device=device),
                                      requires_grad=False)
    return new


def _materialised(state, device):
    """A copy of a quant state whose tensors (absmax, code, offset, the nested state's) are made anew here."""
    out = copy.copy(state)
    for name in ("absmax", "code", "offset"):
        t = getattr(state, name, None)
        if isinstance(t, torch.Tensor):
            setattr(out, name, torch.empty_like(t, device=device))
    if getattr(state, "state2", None) is not None:
        out.state2 = _materialised(state.state2, device)
    return out


def quantized_bytes(model: torch.nn.Module) -> dict:
    """Bytes of the quantized layers' weights and their quant states, and how many parameters they stand for."""
    bnb = _bnb()
    packed = stats = represented = 0
    for m in model.modules():
        if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            w = m.weight
            packed += w.numel() * w.element_size()
            represented += m.in_features * m.out_features
            state = getattr(w, "quant_state", None)
            while state is not None:
                for name in ("absmax", "code", "offset"):
                    t = getattr(state, name, None)
                    if isinstance(t, torch.Tensor):
                        stats += t.numel() * t.element_size()
                state = getattr(state, "state2", None)
            scb = getattr(w, "SCB", None)
            if scb is None:  # after its first forward an 8-bit layer keeps the scales in its matmul state
                scb = getattr(getattr(m, "state", None), "SCB", None)
            if isinstance(scb, torch.Tensor):
                stats += scb.numel() * scb.element_size()
    return {"packed_bytes": packed, "stats_bytes": stats, "quantized_params": represented}


def restore_quant_states(model: torch.nn.Module, state: dict, device) -> dict:
    """Load a checkpoint's quantized layers exactly: the packed weights load as tensors, their quant states
    (absmax, maps, nested statistics: extra keys `NAME.weight.*` that load_state_dict does not take) are rebuilt
    with bitsandbytes' QuantState.from_dict. Returns the state without those keys, for a strict load."""
    bnb = _bnb()
    rest = dict(state)
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        prefix = f"{name}.weight."
        keys = [k for k in rest if k.startswith(prefix)]
        if not keys:
            continue
        qs = {k[len(prefix):]: rest.pop(k) for k in keys}
        module.weight.quant_state = bnb.functional.QuantState.from_dict(qs, device=torch.device(device))
    return rest
