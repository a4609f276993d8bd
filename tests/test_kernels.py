"""Estimates run the target GPU's kernels: the dispatch rule, the autocast policy, and what a step keeps."""

import json

import pytest

from planner.models.kernels import attention_backend, kernel_target

pytest.importorskip("torch")
import torch  # noqa: E402

from planner.records import ProbeConfig  # noqa: E402
from probes.kernels import (  # noqa: E402
    CUDA_FP32,
    CUDA_FP32_SET_OPT_DTYPE,
    CUDA_LOWER,
    CUDA_OTHER,
    CUDA_PROMOTE,
    cuda_autocast_policy,
)
from probes.pilot import Pilot  # noqa: E402

B, S, D, H, V, FFN = 4, 512, 64, 4, 256, 256
GPT2_LIKE = {"layers": 1, "d_model": D, "heads": H, "vocab": V, "dropout": 0.1}


@pytest.mark.parametrize("sm, dtype, hd, mask, dropout, causal, train, expected", [
    ((8, 0), "bfloat16", 64, False, 0.1, True, True, "flash"),       # A100/H100, GPT-2 style
    ((9, 0), "float16", 128, False, 0.0, False, True, "flash"),
    ((8, 0), "bfloat16", 64, True, 0.1, False, True, "efficient"),   # an explicit mask: flash cannot take it
    ((8, 0), "float32", 64, False, 0.1, True, True, "efficient"),    # flash is fp16/bf16 only
    ((7, 5), "float16", 64, False, 0.1, True, True, "efficient"),    # T4: no flash before sm80
    ((7, 5), "bfloat16", 64, False, 0.1, True, True, "math"),        # no bf16 kernels before sm80
    ((8, 6), "bfloat16", 200, False, 0.0, True, True, "efficient"),  # sm86 flash backward: head_dim ≤ 192
    ((8, 6), "bfloat16", 200, False, 0.0, True, False, "flash"),     # ... in training only
    ((8, 0), "bfloat16", 320, False, 0.0, True, True, "efficient"),  # flash: head_dim ≤ 256
    ((7, 0), "float16", 60, False, 0.0, True, True, "math"),         # efficient on sm7x half: head_dim % 8
    ((7, 0), "float32", 60, False, 0.0, True, True, "efficient"),    # ... fp32 on sm7x: no tensor cores, % 1
])
def test_attention_backend_follows_cuda_dispatch(sm, dtype, hd, mask, dropout, causal, train, expected):
    assert attention_backend(sm, dtype, hd, hd, mask, dropout, causal, 512, 512, train) == expected


def test_kernel_targets_of_catalog_gpus():
    assert kernel_target("9.0") == kernel_target("8.6") == kernel_target("10.0") == "sm80+"
    assert kernel_target("7.5") == kernel_target("7.0") == "sm50-75"
    assert kernel_target(None, "rocm") == "sm80+"


def test_cuda_autocast_lists_are_this_torch_builds_own():
    """The lists we emulate are exactly the ops this torch registers for AutocastCUDA (so an upgrade that changes
    CUDA's policy fails here, not silently in an estimate)."""
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    ours = {f"aten::{n}" for n in CUDA_LOWER + CUDA_FP32 + CUDA_FP32_SET_OPT_DTYPE + CUDA_PROMOTE + CUDA_OTHER}
    assert ours == registered


def test_cpu_autocast_casts_as_cuda_would_while_the_policy_is_active():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", torch.bfloat16):
        cpu = (torch.nn.functional.layer_norm(x, (8,)).dtype, torch.softmax(x, -1).dtype, torch.exp(x).dtype,
               torch.mv(w, w[0]).dtype)
    with cuda_autocast_policy(), torch.autocast("cpu", torch.bfloat16):
        cuda = (torch.nn.functional.layer_norm(x, (8,)).dtype, torch.softmax(x, -1).dtype, torch.exp(x).dtype,
                torch.mv(w, w[0]).dtype, torch.log_softmax(x, -1).dtype, x.sum().dtype,
                torch.nn.functional.linear(x.float(), w).dtype)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            torch.nn.functional.binary_cross_entropy(torch.rand(3), torch.rand(3))
    assert cpu == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32)  # the CPU policy differs ...
    assert cuda == (torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float32, torch.float32,
                    torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16):  # ... and is back once the policy is gone
        assert torch.nn.functional.layer_norm(x, (8,)).dtype == torch.bfloat16


def estimate_first_step(tmp_path, target, precision="bf16", params=GPT2_LIKE):
    """The first_step line of an estimate, and the largest storage any op made during it."""
    from probes import memory

    cfg = ProbeConfig(params_json=json.dumps(params, sort_keys=True), micro_batch=B, seq_len=S, eval_seq_len=S,
                      eval_micro_batch=B, mode="estimated", precision=precision, target=target)
    lines, largest = {}, {"first_step": 0}
    pilot = Pilot(cfg, str(tmp_path), lambda k, x: lines.__setitem__(x["phase"], x) if k == "line" else None,
                  "r", "p")
    track = memory.LiveTensorTracker._track

    def watch(tracker, t):  # the biggest storage created while first_step runs
        if "setup" in lines and "first_step" not in lines and not getattr(t, "is_nested", False):
            largest["first_step"] = max(largest["first_step"], t.untyped_storage().nbytes())
        return track(tracker, t)

    memory.LiveTensorTracker._track = watch
    try:
        pilot.run(("setup", "first_step"))
    finally:
        memory.LiveTensorTracker._track = track
    return lines["first_step"], largest["first_step"], pilot.kernels


def test_attention_dropout_for_sm80_keeps_no_s_by_s_tensor_and_matches_a_hand_count(tmp_path):
    line, largest, kernels = estimate_first_step(tmp_path, "sm80+")
    assert kernels.backends == {"flash": 1}
    s_by_s = B * H * S * S * 2
    assert largest < s_by_s, largest  # no tensor as large as one S × S attention matrix (bf16) is ever made
    # Hand count of the first_step peak: inside the backward of log_softmax (grad in and out, fp32 B·S × V).
    params = 4 * (V * D + 4096 * D + 2 * D + 3 * D * D + 3 * D + D * D + D + 2 * D + D * FFN + FFN + FFN * D + D
                  + 2 * D + V * D)
    batch = 2 * B * S * 8  # input_ids, labels (int64)
    bf16_weights = 2 * (3 * D * D + D * D + D * FFN + FFN * D + V * D)  # autocast casts kept by the matmuls
    bsd32, bsd16, stats = B * S * D * 4, B * S * D * 2, 2 * B * S * 4  # fp32 / bf16 activations; LN mean, rstd
    saved = (S * 8                       # position indices (embedding backward)
             + 3 * (bsd32 + stats)       # layer-norm inputs (residual stream, fp32) and their statistics
             + 3 * bsd16                 # layer-norm outputs cast to bf16 for the next matmul (CUDA: LN in fp32)
             + 3 * bsd16                 # q, k, v: views of the qkv projection's output
             + bsd16 + B * H * S * 4 + 16  # flash: output (also proj's input), logsumexp, RNG state
             + 2 * B * S * FFN * 2       # gelu input and output (bf16)
             + B * S * V * 4             # log_softmax output (fp32)
             + 3 * B * S * D)            # dropout masks of embeddings and both residuals: 1 byte per element
    backward = 2 * B * S * V * 4         # log_softmax's grad in and grad out
    hand = params + batch + bf16_weights + saved + backward
    assert abs(line["peak_allocated_bytes"] - hand) <= 0.02 * hand, (line["peak_allocated_bytes"], hand)
    assert line["simulated_reserved_bytes"] >= line["peak_allocated_bytes"]


def test_the_cpu_build_keeps_s_by_s_attention_with_dropout(tmp_path):
    """What the test above guards against: the CPU's math path saves S × S probabilities and a float mask."""
    line, largest, kernels = estimate_first_step(tmp_path, "cpu")
    assert kernels is None
    assert largest >= B * H * S * S * 2
    flash, _, _ = estimate_first_step(tmp_path, "sm80+")
    assert line["peak_allocated_bytes"] > 4 * flash["peak_allocated_bytes"]


def test_sm75_runs_the_memory_efficient_kernel_in_fp16(tmp_path):
    line, largest, kernels = estimate_first_step(tmp_path, "sm50-75", precision="fp16")
    assert kernels.backends == {"efficient": 1}
    assert largest < B * H * S * S * 2
    flash, _, _ = estimate_first_step(tmp_path, "sm80+")
    # Same saved tensors but the RNG state: philox seed and offset (two int64) instead of flash's 16-byte state
    assert abs(line["peak_allocated_bytes"] - flash["peak_allocated_bytes"]) <= 64


@pytest.mark.parametrize("target, precision, backend", [("sm80+", "bf16", "flash"), ("sm50-75", "fp16", "efficient"),
                                                        ("sm50-75", "fp32", "efficient")])
def test_checkpointed_blocks_recompute_with_the_targets_kernels(tmp_path, target, precision, backend):
    """`rentplan estimate --checkpointing on --precision fp16 --target sm50-75` ended first_step in a
    CheckpointError: backward (and with it the recomputation of checkpointed blocks) ran without the target's
    kernels, so the recomputed attention was the CPU build's, saving other tensors than the forward had."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Names.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    cfg = ProbeConfig(params_json=json.dumps(GPT2_LIKE, sort_keys=True), micro_batch=B, seq_len=S, eval_seq_len=S,
                      eval_micro_batch=B, mode="estimated", precision=precision, target=target, checkpointing=True)
    lines = {}
    pilot = Pilot(cfg, str(tmp_path), lambda k, x: lines.__setitem__(x["phase"], x) if k == "line" else None,
                  "r", "p")
    with Names():
        pilot.run(("setup", "first_step"))
    assert lines["first_step"]["verdict"] == "ok", lines["first_step"]["detail"]
    layers = GPT2_LIKE.get("layers", 1)
    assert pilot.kernels.backends == {backend: 2 * layers}  # the forward, and the recomputation in backward
    assert not Names.seen & {"_scaled_dot_product_flash_attention_for_cpu", "bernoulli", "bernoulli_"}
