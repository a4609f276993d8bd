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

What bitsandbytes keeps on the GPU depends on its version, and a run may use another than this machine's (litgpt
pinned bitsandbytes==0.42.0 until late 2024: litgpt pyproject.toml:41 at 60ec41a0). An estimate traces the version
the run will use (`bnb=VERSION`, default this machine's); `BnbSemantics` says what each version's `MatMul4Bit`
(bitsandbytes/autograd/_functions.py) holds, with its source:
- before 0.43.2 its forward keeps the layer's input A as `ctx.tensors = (A, B)` (0.42.0 _functions.py:522-523),
  a plain ctx attribute, not `save_for_backward`: A lives as long as the graph's node, through the whole backward
  and for as long as the caller keeps the step's output or loss. PR #1270 (commit 9e753741, "fix QLoRA mem bug:
  delete useless buffered activation", first in 0.43.2) saves `(None, B)`. A frozen torch linear keeps no input
  (autograd saves `self` of mm only when the weight needs a gradient), so this is memory LoRA does not hold;
- before 0.50.0 its forward dequantizes the whole weight, `F.linear(A, F.dequantize_4bit(B, state).to(A.dtype)
  .t())` (0.42.0 _functions.py:516; 0.49.2 _functions.py:315), a transient of the layer's size in the quant state's
  dtype,
  plus a copy when that differs from the compute dtype (Lightning's BitsandbytesPrecision quantizes from
  float16: lightning/fabric/plugins/precision/bitsandbytes.py:334 at 7e87ce05); 0.50.0 fuses it (gemm_4bit, #1949);
- every version's backward dequantizes the weight again (0.42.0 _functions.py:546; 0.50.0 _functions.py:384).
What no trace can know is the caller's loop: litgpt's finetune/lora.py keeps the last step's `logits` until the
next forward has returned (finetune/lora.py:304 at eda1aaaf), so with bitsandbytes < 0.43.2 every 4-bit layer's
input of the previous step is still held during the next forward. The estimate holds them (the larger need), and
the line says so with their bytes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

QUANTIZE = ("nf4", "fp4", "int8")
COMPUTE_DTYPE = torch.bfloat16
SKIP = ("lm_head", "score", "classifier")  # output heads stay in the compute dtype, as transformers' bnb loading


SAVES_INPUT_UNTIL = (0, 43, 2)  # PR #1270, commit 9e753741: MatMul4Bit keeps (None, B) from 0.43.2 on
FUSED_FORWARD_FROM = (0, 50, 0)  # PR #1949, commit 5453368b: forward through gemm_4bit, no dequantized weight


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


@dataclass(frozen=True)
class BnbSemantics:
    """What a bitsandbytes version's MatMul4Bit keeps (module docstring, with sources)."""

    version: str
    saves_input: bool
    dequantizes_forward: bool

    @classmethod
    def of(cls, version: str) -> "BnbSemantics":
        v = _version(version)
        return cls(str(version), v < SAVES_INPUT_UNTIL, v < FUSED_FORWARD_FROM)


def installed_version() -> str:
    return str(getattr(_bnb(), "__version__", "0"))


def _bnb():
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise RuntimeError("quantize needs bitsandbytes: pip install 'rentplan[quant]'") from None
    return bnb


@dataclass(frozen=True)
class QuantOptions:
    """How the run's loader quantizes. Defaults are transformers' bitsandbytes loading with double quantization;
    Lightning's BitsandbytesPrecision (litgpt) replaces every torch.nn.Linear, the head included
    (bitsandbytes.py:140 at 7e87ce05), quantizes from float16 (:334), and double-quantizes only in its *-dq modes."""

    head: bool = False  # quantize the output head too (a head tied to the input embeddings never is)
    double_quant: bool = True  # absmax itself 8-bit per 256 (compress_statistics); False: float32 per 64
    from_dtype: torch.dtype = COMPUTE_DTYPE  # the quant state's dtype: what dequantize_4bit returns
    bnb: str = ""  # the bitsandbytes version the run uses ("" = this machine's): estimates trace its MatMul4Bit


def _tied(model: torch.nn.Module, lin: torch.nn.Linear) -> bool:
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    return emb is not None and getattr(emb, "weight", None) is lin.weight


def targets(model: torch.nn.Module, head: bool = False) -> list[tuple[torch.nn.Module, str, torch.nn.Linear]]:
    """(parent, attribute, linear) for every linear layer to quantize."""
    out = []
    for _, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear and (name not in SKIP or (head and not _tied(model, child))):
                out.append((parent, name, child))
    return out


def weights_to_quantize(model: torch.nn.Module, head: bool = False) -> set[int]:
    """ids of the weights quantize() replaces: estimates leave them on meta (never materialised unquantized)."""
    return {id(lin.weight) for _, _, lin in targets(model, head)}


def quantize(model: torch.nn.Module, kind: str, device: torch.device, fake: bool,
             options: QuantOptions | None = None) -> torch.nn.Module:
    """Replace the target linears one at a time (only one unquantized weight exists at any moment)."""
    if kind not in QUANTIZE:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE)}, got {kind!r}")
    options = options or QuantOptions()
    semantics = BnbSemantics.of(options.bnb or installed_version())
    emulate = fake and kind != "int8" and semantics != BnbSemantics.of(installed_version())
    held = HeldInputs() if emulate and semantics.saves_input else None
    for parent, name, lin in targets(model, options.head):
        new = (_fake_layer if fake else _real_layer)(lin, kind, device, options)
        if emulate:
            new.__class__ = _as_of_class()
            new.semantics, new.held = semantics, held
        setattr(parent, name, new)
        del lin
    if held is not None:
        held.attach(model)
    return model


class HeldInputs:
    """bitsandbytes < 0.43.2 keeps each 4-bit layer's input on its graph node (module docstring). A loop that keeps
    the step's output until the next forward has returned (litgpt) holds the previous step's inputs through the
    next forward: kept here from the end of one forward of the model to the end of the next."""

    def __init__(self):
        self.current: list[torch.Tensor] = []
        self.previous: list[torch.Tensor] = []
        self.bytes = 0  # the largest step's worth of inputs held, for the line's note

    def keep(self, a: torch.Tensor) -> None:  # called where a gradient flows back (ctx.needs_input_grad)
        self.current.append(a)

    def attach(self, model: torch.nn.Module) -> None:
        def after_forward(module, args, output):
            seen, total = set(), 0
            for t in self.current:
                key = t.untyped_storage()._cdata
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            self.bytes = max(self.bytes, total)
            self.previous, self.current = self.current, []

        model.register_forward_hook(after_forward)
        model._rentplan_held_inputs = self


def held_note(model: torch.nn.Module) -> str:
    """Said on an estimated line whose trace holds the previous step's 4-bit inputs (HeldInputs)."""
    from planner.units import fmt_bytes

    held = getattr(model, "_rentplan_held_inputs", None)
    for m in model.modules():
        held = held or getattr(m, "_rentplan_held_inputs", None)
    if held is None or not held.bytes:
        return ""
    return (f"bitsandbytes < 0.43.2 keeps each 4-bit layer's input on its graph node; a loop that keeps a step's "
            f"output or loss into the next forward (litgpt's) holds the previous step's too: "
            f"{fmt_bytes(held.bytes)}, counted in this peak (it depends on the loop, which no trace sees)")


class _MatMul4BitAsOf(torch.autograd.Function):
    """bitsandbytes' MatMul4Bit as the run's version runs it (BnbSemantics), for estimates only."""

    @staticmethod
    def forward(ctx, A, B, bias, quant_state, semantics, held):
        F = _bnb().functional
        if semantics.dequantizes_forward:  # 0.42.0 _functions.py:516
            output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype), bias)
        else:
            output = _bnb().matmul_4bit(A, B, quant_state=quant_state, bias=bias)
        ctx.state = quant_state
        if not any(ctx.needs_input_grad[:2]):  # 0.42.0 :522-525: nothing kept where no gradient flows back
            ctx.tensors = (None, None)
            return output
        ctx.tensors = (A if semantics.saves_input else None, B)  # 0.42.0 :523; 0.43.2 on: (None, B)
        if semantics.saves_input and held is not None:
            held.keep(A)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        _, B = ctx.tensors
        grad_A = torch.matmul(grad_output, _bnb().functional.dequantize_4bit(B, ctx.state).to(grad_output.dtype))
        return grad_A, None, None, None, None, None


_AS_OF: dict = {}


def _as_of_class():
    """bitsandbytes' Linear4bit whose forward runs _MatMul4BitAsOf (made once, on first use: bnb is optional)."""
    if "cls" not in _AS_OF:
        bnb = _bnb()

        class Linear4bitAsOf(bnb.nn.Linear4bit):
            def forward(self, x):
                inp_dtype = x.dtype
                if self.compute_dtype is not None:
                    x = x.to(self.compute_dtype)
                bias = None if self.bias is None else self.bias.to(self.compute_dtype)
                return _MatMul4BitAsOf.apply(x, self.weight, bias, self.weight.quant_state, self.semantics,
                                             self.held).to(inp_dtype)

        _AS_OF["cls"] = Linear4bitAsOf
    return _AS_OF["cls"]


def _layer(lin: torch.nn.Linear, kind: str, options: QuantOptions):
    bnb = _bnb()
    bias = lin.bias is not None
    if kind == "int8":
        return bnb.nn.Linear8bitLt(lin.in_features, lin.out_features, bias=bias, has_fp16_weights=False,
                                   threshold=0.0, device="meta")
    return bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=bias, compute_dtype=COMPUTE_DTYPE,
                             quant_type=kind, compress_statistics=options.double_quant, quant_storage=torch.uint8,
                             device="meta")


def _real_layer(lin: torch.nn.Linear, kind: str, device: torch.device, options: QuantOptions | None = None):
    bnb, options = _bnb(), options or QuantOptions()
    new = _layer(lin, kind, options)
    if kind == "int8":
        new.weight = bnb.nn.Int8Params(lin.weight.data.to(COMPUTE_DTYPE), requires_grad=False,
                                       has_fp16_weights=False)
    else:
        new.weight = bnb.nn.Params4bit(lin.weight.data.to(options.from_dtype), requires_grad=False, quant_type=kind,
                                       compress_statistics=options.double_quant, quant_storage=torch.uint8)
    if lin.bias is not None:
        new.bias = torch.nn.Parameter(lin.bias.data.to(COMPUTE_DTYPE), requires_grad=False)
    return new.to(device)  # bitsandbytes quantizes as the weight moves to its device


def _fake_layer(lin: torch.nn.Linear, kind: str, device: torch.device, options: QuantOptions | None = None):
    bnb, options = _bnb(), options or QuantOptions()
    from torch.utils._python_dispatch import _disable_current_modes

    if kind == "int8":  # Int8Params after quantization: int8 rows (CB, which is the weight) and a scale per row
        with _disable_current_modes():
            meta = torch.empty(lin.out_features, lin.in_features, dtype=COMPUTE_DTYPE, device="meta")
            cb, scb, _ = bnb.functional.int8_vectorwise_quant(meta)
            new = _layer(lin, kind, options)
        weight = torch.nn.Parameter(torch.empty_like(cb, device=device), requires_grad=False)
        weight.CB, weight.SCB, weight.has_fp16_weights = weight.data, torch.empty_like(scb, device=device), False
        new.weight = weight
        if lin.bias is not None:
            new.bias = torch.nn.Parameter(torch.empty(lin.out_features, dtype=COMPUTE_DTYPE, device=device),
                                          requires_grad=False)
        return new

    with _disable_current_modes():  # on meta, outside the estimate's modes: shapes only
        meta = torch.empty(lin.out_features, lin.in_features, dtype=options.from_dtype, device="meta")
        packed, state = bnb.functional.quantize_4bit(meta, blocksize=64, compress_statistics=options.double_quant,
                                                     quant_type=kind, quant_storage=torch.uint8)
        new = _layer(lin, kind, options)
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
