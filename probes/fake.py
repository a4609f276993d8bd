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
- `empty`/`empty_strided` without a device or on the CPU: fake_impls.constructors with device meta.

Anything else, or a constant input (AdamW's step counts are constants, and their values are read), takes
FakeTensorMode's own path. A test runs whole estimates both ways and finds every figure of every phase equal.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

aten = torch.ops.aten
_CPU = torch.device("cpu")
DIRECT_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
                aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim,
                aten.squeeze.dims, aten.slice.Tensor, aten.select.int, aten.detach.default, aten.alias.default,
                aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int, aten._reshape_alias.default}
DIRECT_COPIES = {aten._to_copy.default, aten.clone.default, aten.empty_like.default, aten.zeros_like.default,
                 aten.ones_like.default}
DIRECT_CONSTRUCTORS = {aten.empty.memory_format, aten.empty_strided.default}


def _direct(func) -> bool:
    return func in DIRECT_VIEWS or func in DIRECT_COPIES or func.__name__.startswith("_foreach_")


class EstimateFakeMode(FakeTensorMode):
    """FakeTensorMode(allow_non_fake_inputs=True) with the direct path above (set `direct = False` for none)."""

    direct = True

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)

    def _cached_dispatch_impl(self, func, types, args, kwargs):
        if self.direct and self.shape_env is None and kwargs.get("device") in (None, _CPU):
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
