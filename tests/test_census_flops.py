"""The census's FLOPs where torch's formulas count work the kernels do not do (probes/census.py): a grouped
convolution's weight gradient (torch.utils.flop_counter leaves the groups out) and causal attention (the fused
kernels skip the masked tiles). Each is checked against the multiply-adds counted by hand."""

import pytest
import torch
import torch.nn.functional as F

from planner.inputs.catalog import load_catalog
from planner.models.roofline import FAST, update_seconds
from probes.census import OpCensus
from probes.fake import EstimateFakeMode
from probes.kernels import target_kernels


def conv_rows(groups, c_in=16, c_out=16, k=7):
    x = torch.randn(2, c_in, 12, 12, requires_grad=True)
    w = torch.randn(c_out, c_in // groups, k, k, requires_grad=True)
    counter = OpCensus()
    with counter:
        F.conv2d(x, w, padding=k // 2, groups=groups).square().mean().backward()
    return [r for r in counter.profile()["ops"] if r[0] in ("conv", "depthwise")]


@pytest.mark.parametrize("groups,c_out,kind", [(1, 16, "conv"), (4, 16, "conv"), (16, 16, "depthwise"),
                                               (16, 32, "depthwise")])
def test_a_convolutions_backward_counts_each_gradient_at_the_forwards_multiply_adds(groups, c_out, kind):
    forward = 2 * 2 * c_out * (16 // groups) * 12 * 12 * 7 * 7  # 2 × batch × C_out × C_in/g × H × W × k²
    rows = conv_rows(groups, c_out=c_out)
    assert {r[0] for r in rows} == {kind}
    assert sorted(r[2] for r in rows) == [forward, 2 * forward]  # forward; input and weight gradients


def test_torch_alone_counts_a_depthwise_weight_gradient_channels_times_over():
    """What the census corrects: if torch's formula is ever fixed upstream (pytorch/pytorch#183405) this test
    fails, and the census's own count (which does not depend on it) can be dropped."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(2, 16, 12, 12, requires_grad=True)
    w = torch.randn(16, 1, 7, 7, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        F.conv2d(x, w, padding=3, groups=16).square().mean().backward()
    forward = 2 * 2 * 16 * 12 * 12 * 49
    assert fc.get_total_flops() == forward + forward + 16 * forward


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_causal_attention_counts_the_unmasked_share_of_the_scores(dtype):
    s = 128
    out = {}
    for causal in (False, True):
        with EstimateFakeMode(), target_kernels("sm80+"):
            q = torch.randn(2, 4, s, 64, dtype=dtype, requires_grad=True)
            counter = OpCensus()
            with counter:
                F.scaled_dot_product_attention(q, q, q, is_causal=causal).sum().backward()
        out[causal] = sorted(r[2] for r in counter.profile()["ops"] if r[0] == "attention")
    assert len(out[True]) == 2  # forward and backward, both fused kernels
    assert out[True] == [f * (s + 1) // (2 * s) for f in out[False]]


def test_an_explicit_mask_is_counted_in_full():
    with EstimateFakeMode(), target_kernels("sm80+"):
        q = torch.randn(2, 4, 64, 32, dtype=torch.float16, requires_grad=True)
        mask = torch.ones(64, 64, dtype=torch.bool).tril()
        counter = OpCensus()
        with counter:
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
        full = OpCensus()
        with full:
            F.scaled_dot_product_attention(q, q, q).sum().backward()
    masked = sorted(r[2] for r in counter.profile()["ops"] if r[0] == "attention")
    assert masked and masked == sorted(r[2] for r in full.profile()["ops"] if r[0] == "attention")


def test_a_depthwise_conv_is_timed_on_the_cuda_cores_not_the_tensor_cores():
    h100 = load_catalog().gpu("h100_sxm")
    t = update_seconds([("depthwise", "float16", 1e12, 0, 1)], 0, h100, tf32=False, fr=FAST)
    assert t == pytest.approx(1e12 / (h100.fp32_tflops * 1e12 * FAST.matmul))
    conv = update_seconds([("conv", "float16", 1e12, 0, 1)], 0, h100, tf32=False, fr=FAST)
    assert conv < t / 10  # an fp16 conv as an implicit GEMM runs on the tensor cores


def test_a_linear_layers_matmuls_record_their_output_grid_and_token_axis():
    """Forward and input gradient grow with the tokens (axis "m"); the weight gradient (out × in) does not."""
    x = torch.randn(6, 5, 24, requires_grad=True)  # 30 tokens
    lin = torch.nn.Linear(24, 40)
    counter = OpCensus()
    with counter:
        lin(x).square().mean().backward()
    grids = sorted(r[5] for r in counter.profile()["ops"] if r[0] == "matmul")
    assert grids == sorted([[1, 30, 40, "m"], [1, 30, 24, "m"], [1, 40, 24, "-"]])
    a, b = torch.randn(3, 7, 8), torch.randn(3, 8, 9)
    counter = OpCensus()
    with counter:
        torch.bmm(a, b)
    assert [r[5] for r in counter.profile()["ops"] if r[0] == "matmul"] == [[3, 7, 9, "b"]]


def rnn_profile(cell, batch=4, steps=24, i=48, h=32, layers=2, bidirectional=False, dtype=torch.float32):
    rnn = getattr(torch.nn, cell)(i, h, num_layers=layers, batch_first=True, bidirectional=bidirectional).to(dtype)
    x = torch.randn(batch, steps, i, dtype=dtype, requires_grad=True)
    counter = OpCensus()
    with counter:
        rnn(x)[0].float().square().mean().backward()
    return counter.profile()


@pytest.mark.parametrize("bidirectional", [False, True])
def test_an_lstms_update_counts_its_gate_matmuls_step_by_step(bidirectional):
    """nn.LSTM on the CPU is one oneDNN op per layer (mkldnn_rnn_layer and its backward), with no FLOP formula in
    torch: the census counts what cuDNN runs, the input projection as one GEMM over every step, the recurrent
    one step by step (the steps depend on each other); backward twice the forward (input and weight gradients)."""
    b, t, i, h, layers, d, gates = 4, 24, 48, 32, 2, 2 if bidirectional else 1, 4
    profile = rnn_profile("LSTM", b, t, i, h, layers, bidirectional)
    per_direction = [2 * t * b * gates * h * (i if layer == 0 else d * h) + 2 * t * b * gates * h * h
                     for layer in range(layers)]
    forward = d * sum(per_direction)
    rnn_flops = sum(r[2] * r[4] for r in profile["ops"] if r[0] == "matmul")
    assert rnn_flops == pytest.approx(3 * forward, rel=1e-9), "forward + input gradients + weight gradients"
    steps = [r for r in profile["ops"] if r[0] == "matmul" and len(r) > 5 and r[5][3] == "r"]
    assert sum(r[4] for r in steps) == 2 * t * layers * d  # one recurrent GEMM per step, forward and backward
    assert {r[5][1] for r in steps} == {b}
    assert profile["launches"] >= sum(r[4] for r in profile["ops"])


def test_a_recurrent_census_scales_steps_with_seq_len_and_rows_with_the_micro_batch():
    from planner.models.roofline import scale_rows

    profile = rnn_profile("LSTM")
    flops = sum(r[2] * r[4] for r in profile["ops"])
    for tokens, seq in ((2.0, 1.0), (2.0, 2.0), (4.0, 2.0)):  # micro-batch ×2; seq_len ×2; both
        rows = scale_rows(profile, tokens, seq, 1.0)
        assert sum(r[2] * r[4] for r in rows) == pytest.approx(flops * tokens)
        step = [r for r in rows if len(r) > 5 and r[5][3] == "r"]
        assert sum(r[4] for r in step) == pytest.approx(2 * 24 * 2 * seq)
        assert {r[5][1] for r in step} == {round(4 * tokens / seq)}


def test_an_lstm_update_on_an_h100_takes_at_least_its_flops_at_the_peak():
    from planner.models.roofline import Census

    gpu = load_catalog().gpu("h100_sxm")
    profile = rnn_profile("LSTM", batch=8, steps=256, i=512, h=512)
    census = Census("sm80+", profile, 8, 256, 1)
    seconds = census.seconds(gpu, 8, 256, 1, FAST)
    assert seconds > profile["flops"] / (gpu.fp32_tflops * 1e12)


def test_a_workload_states_channels_last_and_the_census_records_it():
    """The workload contract's `memory_format`: the harness (probes/loop.Trainer) puts the model's 4-D weights and
    the batch's images in NHWC, so cuDNN would run the convolutions channels-last, and the census (on the line's
    op_profile_json) says which layout they ran in; an unknown format is refused where the workload is loaded."""
    from planner.errors import WorkloadError
    from planner.records import ProbeConfig
    from probes.census import census as count
    from probes.workloads import load_workload

    ref = "tests/workloads.py:resnet50_like"
    cfg = ProbeConfig(workload=ref, micro_batch=2, seq_len=32, precision="fp32", mode="estimated", target="sm80+")
    for fmt in ("channels_last", "contiguous"):
        assert count(load_workload(ref, {"memory_format": fmt, "blocks": 1, "classes": 10}), cfg)[
            "conv_memory_format"] == fmt
    with pytest.raises(WorkloadError, match="memory_format 'nhwc'"):
        load_workload(ref, {"memory_format": "nhwc"})
