"""FakeTensorMode for estimates, with a direct path for the ops whose fake result is their meta kernel's.

An estimate spends most of its time in FakeTensorMode's dispatch, and most of that in building cache keys:
a foreach op of AdamW hashes the metadata of every tensor in its lists (four lists of 390 on a 7B model), a
view goes through a Python reference implementation. For the ops listed here FakeTensorMode's answer, when
every input is a non-constant fake tensor of this mode on one device and there are no symbolic shapes, is the
op's meta kernel run on the inputs (`in_kernel_invocation_manager`), wrapped as fake tensors on that device:

- views (DIRECT_VIEWS): no storage of their own. FakeTensorMode computes `view` and `_unsafe_view` with
  torch._refs' helper and `slice`/`select` with fake_impls' own, the C++ meta kernel here: the same sizes,
  and the same storage; strides can differ only where a dimension has size 1, which no byte count reads;
- copies and like-constructors: FakeTensorMode runs the same meta kernel (fake_impls.constructors moves
  `device` to meta and back, which the direct path needs not do when no device is asked for);
- foreach ops: the meta registrations of torch/_meta_registrations.py, which FakeTensorMode also runs;
- `empty`/`empty_strided` without a device or on the CPU: fake_impls.constructors with device meta;
- `lift_fresh` of a small real CPU tensor (torch.tensor(number)): FakeTensorMode clones it and converts the clone
  (from_real_tensor, make_constant=True): a fake of the same sizes and strides on the CPU holding the clone as its
  constant. The converter's memo of the clone is never read (nothing else holds the clone), so it is left out.

Anything else, or a constant input (AdamW's step counts are constants, and their values are read), takes
FakeTensorMode's own path. A test runs whole estimates both ways and finds every figure of every phase equal.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._mode_utils import no_dispatch

aten = torch.ops.aten
_CPU = torch.device("cpu")
DIRECT_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
                aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.detach.default, aten.alias.default,
                aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten._reshape_alias.default}
DIRECT_COPIES = {aten._to_copy.default, aten.clone.default, aten.empty_like.default, aten.zeros_like.default,
                 aten.ones_like.default}
DIRECT_CONSTRUCTORS = {aten.empty.memory_format, aten.empty_strided.default}


RNN_LAYER = aten.mkldnn_rnn_layer.default
# Ops whose fake result can differ from the kernel the target runs, named on the estimate's line: an estimate
# that meets one says what it did about it (planner reads them as they are).
UNVERIFIED = {  # op -> (on the CPU's own kernels, for a GPU target)
    RNN_LAYER: ("nn.LSTM/GRU/RNN: oneDNN's training workspace queried from the real kernel (small shapes, extended)",
                "nn.LSTM/GRU/RNN: cuDNN's reserve space is not modelled (oneDNN's CPU workspace stands in)"),
    aten.convolution.default: (None, "convolution: cuDNN's algorithm workspace is not modelled"),
}
_RNN_WS: dict = {}


def rnn_workspace_bytes(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers,
                        has_biases, bidirectional, batch_first, train) -> int:
    """The workspace oneDNN's forward-training RNN primitive returns for one layer (what `mkldnn_rnn_layer` hands
    its backward). oneDNN sizes each part of it as a product of the steps (+1), the batch and padded leading
    dimensions, page-aligned (src/cpu/rnn/rnn_utils.cpp, set_conf and set_offsets), so it is bilinear in steps
    and batch: queried from the real kernel at 16/32 steps × batch 4/8 with this layer's own widths and dtype
    (a few KiB of compute), then extended; within 0.5 % of the real size on the shapes checked (tests)."""
    if not train:
        return 0
    from torch.utils._python_dispatch import _disable_current_modes

    batch = int(hx.shape[0]) if hx is not None and hx.dim() == 2 else int(input.shape[1])
    steps_first = int(input.shape[1]) == batch  # the kernel takes (steps, batch, features) here
    key = (tuple(input.shape[2:]), input.dtype, tuple(tuple(w.shape) for w in (w0, w1, w2, w3)), w0.dtype,
           tuple(hx.shape[1:]) if hx is not None else None, bool(reverse), int(mode), int(hidden_size),
           bool(has_biases), bool(bidirectional), bool(batch_first), steps_first)
    if key not in _RNN_WS:
        with _disable_current_modes():  # real tensors of the layer's widths, a few steps
            def size(t: int, b: int) -> int:
                shape = (t, b, *input.shape[2:]) if steps_first else (b, t, *input.shape[2:])
                real = [torch.zeros(w.shape, dtype=w.dtype) for w in (w0, w1, w2, w3)]
                h = torch.zeros((b, *hx.shape[1:]), dtype=hx.dtype)
                c = torch.zeros((b, *cx.shape[1:]), dtype=cx.dtype)
                out = RNN_LAYER(torch.zeros(shape, dtype=input.dtype), *real, h, c, reverse, batch_sizes, mode,
                                hidden_size, num_layers, has_biases, bidirectional, batch_first, train)
                return int(out[3].numel() * out[3].element_size())
            p = {(t, b): size(t, b) for t in (16, 32) for b in (4, 8)}
        d = (p[32, 8] - p[32, 4] - p[16, 8] + p[16, 4]) / 64
        per_step = (p[32, 4] - p[16, 4]) / 16 - 4 * d
        per_row = (p[16, 8] - p[16, 4]) / 4 - 16 * d
        _RNN_WS[key] = (p[16, 4] - 16 * per_step - 4 * per_row - 64 * d, per_step, per_row, d)
    a, per_step, per_row, d = _RNN_WS[key]
    steps = int(input.shape[0] if steps_first else input.shape[1])
    return max(0, int(round(a + per_step * steps + per_row * batch + d * steps * batch)))


LIFT_FRESH = aten.lift_fresh.default


def _liftable(args, kwargs) -> bool:
    """torch.tensor(number) under the mode: a small, plain, dense CPU tensor lifted as a constant (AdamW makes one
    per parameter for its step count; a resumed estimate, one per saved step)."""
    if kwargs or len(args) != 1:
        return False
    t = args[0]
    return (type(t) is torch.Tensor and t.device == _CPU and t.layout == torch.strided and not t.requires_grad
            and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _direct(func) -> bool:
    return func in DIRECT_VIEWS or func in DIRECT_COPIES or func.__name__.startswith("_foreach_")


class EstimateFakeMode(FakeTensorMode):
    """FakeTensorMode(allow_non_fake_inputs=True) with the direct path above (set `direct = False` for none)."""

    direct = True

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.unverified: set = set()  # ops met whose fake memory can differ from the kernel (UNVERIFIED)

    def unverified_note(self, gpu_target: bool) -> str:
        notes = sorted(filter(None, (UNVERIFIED[f][1 if gpu_target else 0] for f in self.unverified)))
        return "; ".join(notes)

    def _cached_dispatch_impl(self, func, types, args, kwargs):
        if func in UNVERIFIED:
            self.unverified.add(func)
        if func is RNN_LAYER:  # the meta kernel leaves oneDNN's training workspace empty: size it
            out = super()._cached_dispatch_impl(func, types, args, kwargs)
            size = rnn_workspace_bytes(*args, **kwargs)
            with in_kernel_invocation_manager(self):
                ws = torch.empty(size, dtype=torch.uint8, device="meta")
            return (*out[:3], FakeTensor(self, ws, out[3].fake_device))
        if self.direct and self.shape_env is None and kwargs.get("device") in (None, _CPU):
            if func is LIFT_FRESH and _liftable(args, kwargs) and self.may_turn_const(args[0]):
                with no_dispatch():  # a copy of the value, kept as the constant, as FakeTensorMode keeps it
                    value = args[0].clone()
                with in_kernel_invocation_manager(self):
                    r = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
                return FakeTensor(self, r, _CPU, constant=value)
            if func in DIRECT_CONSTRUCTORS:
                with in_kernel_invocation_manager(self):
                    r = func(*args, **{**kwargs, "device": "meta"})
                return FakeTensor(self, r, _CPU)
            if _direct(func) and "device" not in kwargs:
                device = self._common_device(args, kwargs)
                if device is not None:
                    with in_kernel_invocation_manager(self):
                        r = func(*args, **kwargs)
                    return self._wrap(r, device)
        return super()._cached_dispatch_impl(func, types, args, kwargs)

    def _common_device(self, args, kwargs) -> torch.device | None:
        """The one device of the inputs, when every tensor input is a non-constant fake of this mode."""
        device = None
        for x in (*args, *kwargs.values()):
            for t in (x if isinstance(x, (list, tuple)) else (x,)):
                if not isinstance(t, torch.Tensor):
                    continue
                if type(t) is not FakeTensor or t.fake_mode is not self or t.constant is not None:
                    return None
                if device is None:
                    device = t.fake_device
                elif t.fake_device != device:
                    return None
        return device

    def _wrap(self, r, device: torch.device):
        if r is None or type(r) is FakeTensor:  # in-place foreach ops return nothing; `to` may return its input
            return r
        if isinstance(r, torch.Tensor):
            return FakeTensor(self, r, device)
        return [t if type(t) is FakeTensor else FakeTensor(self, t, device) for t in r]
