"""Estimates take a direct path through FakeTensorMode for views, copies, like-constructors and foreach ops
(probes/fake.py). It must leave every result FakeTensorMode itself gives unchanged: op by op, and figure by
figure over whole estimates."""

import json

import pytest

from planner.records import PHASES, ProbeConfig
from tests.conftest import WORKLOADS

torch = pytest.importorskip("torch")
from torch._subclasses.fake_tensor import FakeTensor  # noqa: E402

from probes.fake import DIRECT_CONSTRUCTORS, DIRECT_COPIES, DIRECT_VIEWS, EstimateFakeMode  # noqa: E402
from probes.pilot import Pilot  # noqa: E402

aten = torch.ops.aten


def _cases(x, y, lst):
    """(op, args, kwargs) covering every op the direct path takes, on fake inputs x (4×6×8), y (same), lst."""
    return [
        (aten.view.default, (x, [24, 8]), {}), (aten._unsafe_view.default, (x, [4, 48]), {}),
        (aten.t.default, (x[0],), {}), (aten.transpose.int, (x, 0, 2), {}), (aten.permute.default, (x, [2, 0, 1]), {}),
        (aten.expand.default, (x[:, :1], [4, 5, 8]), {}), (aten.unsqueeze.default, (x, 1), {}),
        (aten.squeeze.dim, (x[:, :1], 1), {}), (aten.squeeze.dims, (x[:, :1], [1]), {}),
        (aten.slice.Tensor, (x, 1, 2, 5), {}), (aten.select.int, (x, 2, 3), {}), (aten.detach.default, (x,), {}),
        (aten.alias.default, (x,), {}), (aten.split.Tensor, (x, 3, 1), {}),
        (aten.split_with_sizes.default, (x, [1, 3], 0), {}), (aten.unbind.int, (x, 1), {}),
        (aten._reshape_alias.default, (x, [4, 48], [48, 1]), {}),
        (aten._to_copy.default, (x,), {"dtype": torch.bfloat16}), (aten._to_copy.default, (x.transpose(0, 2),), {}),
        (aten.clone.default, (x.transpose(0, 1),), {}),
        (aten.clone.default, (x.transpose(0, 1),), {"memory_format": torch.contiguous_format}),
        (aten.empty_like.default, (x.permute(2, 0, 1),), {}), (aten.zeros_like.default, (x,), {"dtype": torch.float16}),
        (aten.ones_like.default, (x,), {}),
        (aten.empty.memory_format, ([3, 5],), {"dtype": torch.bfloat16}),
        (aten.empty.memory_format, ([3, 5],), {"device": torch.device("cpu")}),
        (aten.empty_strided.default, ([3, 5], [1, 3]), {"dtype": torch.float32}),
        (aten._foreach_sqrt.default, (lst,), {}), (aten._foreach_add_.List, (lst, lst), {"alpha": 2.0}),
        (aten._foreach_mul.Scalar, (lst, 0.5), {}), (aten._foreach_addcdiv_.Scalar, (lst, lst, lst, 0.1), {}),
        (aten._foreach_lerp_.Scalar, (lst, lst, 0.9), {}), (aten._foreach_norm.Scalar, (lst, 2), {}),
        (aten._foreach_mul_.Tensor, (lst, y.sum()), {}),
    ]


def _describe(out, inputs):
    """What a fake result is: per tensor its class, shape, strides, dtype, device, storage size and which input's
    storage it shares (None: a storage of its own)."""
    if out is None:
        return None
    flat = [out] if isinstance(out, torch.Tensor) else list(out)
    storages = [t.untyped_storage()._cdata for t in inputs]
    return [(type(t).__name__, tuple(t.shape), t.stride(), t.dtype, t.device, t.untyped_storage().nbytes(),
             storages.index(t.untyped_storage()._cdata) if t.untyped_storage()._cdata in storages else None)
            for t in flat]


def test_every_direct_op_gives_what_fake_tensor_mode_gives():
    covered = set()
    for direct in (True, False):
        mode = EstimateFakeMode()
        mode.direct = direct
        with mode:
            x, y = torch.empty(4, 6, 8), torch.empty(4, 6, 8)
            lst = [torch.empty(3, 5), torch.empty(7)]
            inputs = [x, y, *lst]
            got = []
            for op, args, kwargs in _cases(x, y, lst):
                got.append((str(op), _describe(op(*args, **kwargs), inputs)))
                covered.add(op)
        if direct:
            fast = got
    assert len(fast) == len(got)
    for a, b in zip(fast, got):
        assert a == b
    assert DIRECT_VIEWS | DIRECT_COPIES | DIRECT_CONSTRUCTORS <= covered


def test_torch_tensor_of_a_number_lifts_as_fake_tensor_mode_lifts_it(monkeypatch):
    """torch.tensor(number) takes the direct path (a fake holding a copy as its constant); larger values keep
    FakeTensorMode's own. Same result either way, the constant's value included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    own = []  # ops that went on to FakeTensorMode's own dispatch
    monkeypatch.setattr(FakeTensorMode, "_cached_dispatch_impl", lambda self, func, *a, real=(
        FakeTensorMode._cached_dispatch_impl): own.append(func) or real(self, func, *a))
    got = []
    for direct in (True, False):
        mode = EstimateFakeMode()
        mode.direct = direct
        own.clear()
        with mode:
            made = [torch.tensor(2.5), torch.tensor(7), torch.tensor(1.0, dtype=torch.bfloat16),
                    torch.tensor(True), torch.tensor([1.0, 2.0, 3.0])]
            took = len(own)
            got.append([(_describe(t, []), None if t.constant is None else t.constant.tolist(),
                         type(t.constant).__name__, t.requires_grad) for t in made])
            assert [x[1] for x in got[-1]] == [2.5, 7, 1.0, True, None]
        assert took == (1 if direct else 5)  # directly: all but the three-element tensor
    assert got[0] == got[1]


def test_the_direct_path_is_taken_and_constants_keep_fake_tensor_modes_path():
    """Views of a fake skip the cache; a constant (AdamW's step count) still gets FakeTensorMode's constant
    propagation, so its value is read as it counts up."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = EstimateFakeMode()
    with mode:
        x = torch.empty(8, 8)
        misses, hits = FakeTensorMode.cache_misses, FakeTensorMode.cache_hits
        x.view(64, 1).t().detach()
        assert (FakeTensorMode.cache_misses, FakeTensorMode.cache_hits) == (misses, hits)
        with pytest.raises(RuntimeError, match="view size is not compatible"):  # the meta kernel's own checks
            x.t().view(64)
        p = torch.nn.Parameter(torch.empty(4, 4))
        opt = torch.optim.AdamW([p], foreach=True)
        for _ in range(3):
            p.grad = torch.empty(4, 4)
            opt.step()
        step = opt.state[p]["step"]
        assert type(step) is FakeTensor and step.constant is not None and step.item() == 3.0


SMALL = {"layers": 2, "d_model": 64, "heads": 2, "vocab": 128}
CASES = [
    pytest.param("builtin:gpt", {**SMALL, "dropout": 0.1}, dict(precision="bf16", target="sm80+"), id="gpt-sm80"),
    pytest.param("builtin:gpt", SMALL, dict(precision="fp16", target="sm50-75", checkpointing=True),
                 marks=pytest.mark.slow, id="gpt-sm75-fp16-ckpt"),
    pytest.param("builtin:classifier", {}, dict(precision="fp32", target="cpu", optimizer="sgd"),
                 marks=pytest.mark.slow, id="classifier-cpu-sgd"),
    pytest.param(f"{WORKLOADS}:conv_audio", {}, dict(precision="bf16", target="sm80+", optimizer="adamw_fused"),
                 marks=pytest.mark.slow, id="conv-fused"),
    pytest.param(f"{WORKLOADS}:hf_from_config", {"kind": "llama"}, dict(precision="bf16", target="sm80+"),
                 marks=pytest.mark.slow, id="hf-llama"),
    pytest.param(f"{WORKLOADS}:hf_from_config", {"kind": "t5"}, dict(precision="bf16", target="sm50-75"),
                 marks=pytest.mark.slow, id="hf-t5"),
]


@pytest.mark.parametrize("ref, params, kw", CASES)
@pytest.mark.slow  # more than a few seconds: runs in make test-slow and CI
def test_whole_estimates_are_the_same_with_and_without_the_direct_path(tmp_path, monkeypatch, ref, params, kw):
    if ref.endswith("hf_from_config"):
        pytest.importorskip("transformers")

    def run():
        cfg = ProbeConfig(workload=ref, params_json=json.dumps(params, sort_keys=True), micro_batch=2, seq_len=64,
                          eval_seq_len=128, mode="estimated", **kw)
        lines = {}
        Pilot(cfg, str(tmp_path), lambda k, x: lines.__setitem__(x["phase"], x) if k == "line" else None,
              "r", "p").run(PHASES)
        return lines

    direct = run()
    monkeypatch.setattr(EstimateFakeMode, "direct", False)
    full = run()
    for phase in PHASES:
        assert direct[phase]["verdict"] == full[phase]["verdict"] == "ok", direct[phase]["detail"]
        for field in ("peak_allocated_bytes", "simulated_reserved_bytes", "baseline_allocated_bytes",
                      "optimizer_state_bytes", "checkpoint_bytes", "flops_per_update", "ops_per_update",
                      "op_profile_json", "detail"):
            assert direct[phase].get(field) == full[phase].get(field), (phase, field)
