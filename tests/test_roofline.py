"""The per-op time model (planner/models/roofline.py) by hand, and plans made from estimates (census, reserved)."""

import json
import math

import pytest

from planner.inputs.catalog import load_catalog
from planner.models.roofline import FAST, POINT, SLOW, Census, update_seconds

CATALOG = load_catalog()
H100 = CATALOG.gpu("h100_sxm")


def census(rows, launches=None, precision="highest", mb=1, seq=1, accum=1):
    n = sum(r[4] for r in rows)
    return Census("sm80+", {"ops": rows, "launches": launches or n, "float32_matmul_precision": precision},
                  mb, seq, accum)


def test_a_matmul_takes_its_flops_at_the_dtype_peak_times_the_achieved_fraction():
    flops = 2 * 8192**3
    t = update_seconds([("matmul", "bfloat16", flops, 3 * 8192 * 8192 * 2, 1)], 0, H100, False, SLOW)
    assert math.isclose(t, flops / (H100.bf16_dense_tflops * 1e12 * SLOW.matmul))
    fast = update_seconds([("matmul", "bfloat16", flops, 0, 1)], 0, H100, False, FAST)
    point = update_seconds([("matmul", "bfloat16", flops, 0, 1)], 0, H100, False, POINT)
    assert fast < point < t
    # the point is the GPU's MAMF times the share calibrated on the public H100 runs (roofline.POINT)
    assert math.isclose(point, flops / (H100.mamf_bf16_tflops * 1e12 * POINT.of_mamf))
    assert 0.8 < POINT.of_mamf < 1.0 and SLOW.memory <= POINT.memory <= FAST.memory


def test_fp32_matmuls_use_the_non_tensor_peak_unless_tf32_is_on():
    flops = 2 * 4096**3
    off = update_seconds([("matmul", "float32", flops, 0, 1)], 0, H100, False, POINT)
    on = update_seconds([("matmul", "float32", flops, 0, 1)], 0, H100, True, POINT)
    assert H100.fp32_tflops < H100.tf32_dense_tflops
    assert math.isclose(off / on, H100.tf32_dense_tflops / H100.fp32_tflops)


def test_memory_bound_ops_take_their_bytes_at_the_bandwidth_and_at_least_one_launch():
    big = update_seconds([("memory", "bfloat16", 0, 3 * 10**9, 1)], 0, H100, False, POINT)
    assert math.isclose(big, 3e9 / (H100.mem_bandwidth_tbps * 1e12 * POINT.memory))
    tiny = update_seconds([("memory", "float32", 0, 512, 1000)], 0, H100, False, POINT)
    assert math.isclose(tiny, 1000 * POINT.launch_s)  # launch-bound
    extra = update_seconds([("foreach", "float32", 0, 512, 10)], 90, H100, False, POINT)
    assert math.isclose(extra, 100 * POINT.launch_s)  # foreach ops launch more than once


def test_a_census_scales_to_the_planned_shape():
    c = census([("matmul", "bfloat16", 10**12, 10**6, 4), ("attention", "bfloat16", 10**11, 10**5, 2),
                ("foreach", "float32", 0, 10**8, 3)], mb=2, seq=512, accum=1)
    rows, _ = c.rows_for(micro_batch=4, seq_len=1024, grad_accum=2)
    mm, att, opt = rows
    assert mm[2] == 4 * 10**12 and mm[4] == 8  # 4× the tokens per micro-batch, twice the micro-batches
    assert att[2] == 8 * 10**11  # attention FLOPs also grow with seq_len
    assert opt == ("foreach", "float32", 0, 10**8, 3)  # the optimizer step does not depend on the batch


pytest.importorskip("torch")
WIDE = {"layers": 1, "d_model": 4096, "heads": 32, "vocab": 2048}  # matmul time dominates at 16k tokens


@pytest.fixture(scope="module")
def estimated(tmp_path_factory):
    """Estimates made the way `rentplan estimate` makes them (run_grid), for a matmul-heavy model."""
    from planner.records import ProbeConfig
    from probes.runner import run_grid

    path = str(tmp_path_factory.mktemp("est") / "ledger.db")
    params = json.dumps(WIDE, sort_keys=True)
    configs = [ProbeConfig(params_json=params, micro_batch=mb, seq_len=1024, eval_seq_len=1024, eval_micro_batch=mb,
                           precision=prec, mode="estimated", target="sm80+")
               for prec in ("fp32", "bf16") for mb in (4, 8, 16)]
    run_grid(configs, path, progress=lambda m: None)
    return path


@pytest.mark.slow
def test_fp32_on_an_h100_is_planned_slower_than_bf16_by_about_their_peaks(estimated):
    from planner.decisions.pipeline import make_plan
    from planner.ledger import read_lines
    from tests.test_recommendations import campaign

    lines = read_lines(estimated)
    sheets = {p: make_plan(campaign(params=WIDE, precision=p, seq_len=1024, effective_batch=16,
                                    eval={"every_updates": 50, "examples": 64, "seq_len": 1024}),
                           lines, CATALOG).sheet for p in ("fp32", "bf16")}
    fp32, bf16 = (s[s["offer"] == "lambda-h100_sxm-1x"].iloc[0] for s in (sheets["fp32"], sheets["bf16"]))
    assert fp32["micro_batch"] == bf16["micro_batch"]
    ratio = fp32["update_s_point"] / bf16["update_s_point"]
    peaks = H100.bf16_dense_tflops / H100.fp32_tflops * (H100.mamf_bf16_tflops / H100.bf16_dense_tflops)
    assert 0.8 * peaks < ratio <= peaks * 1.01, (ratio, peaks)  # mostly matmul time: close to the peaks' ratio
    assert "non-tensor fp32 (TF32 off)" in fp32["time_basis"] and "per-op roofline" in fp32["time_basis"]
    assert fp32["update_s_low"] <= fp32["update_s_point"] <= fp32["update_s_high"]


def test_estimated_lines_carry_simulated_reserved_and_the_need_says_so(estimated):
    from planner.decisions.pipeline import make_plan
    from planner.ledger import read_lines
    from tests.test_recommendations import campaign

    lines = read_lines(estimated)
    assert (lines["simulated_reserved_bytes"] >= lines["peak_allocated_bytes"]).all()
    assert lines["peak_reserved_bytes"].isna().all()  # never a device counter on a CPU
    sheet = make_plan(campaign(params=WIDE, precision="bf16", seq_len=1024,
                               eval={"every_updates": 50, "examples": 64, "seq_len": 1024}), lines, CATALOG).sheet
    row = sheet[sheet["offer"] == "lambda-h100_sxm-1x"].iloc[0]
    assert "simulated by a model of CUDA's caching allocator" in row["need_basis"]
    assert "sm80+ kernels" in row["need_basis"]
    assert "estimated for the target's kernels" in row["evidence"]
    # sm90, two threads: 2 × cuBLAS 32 MiB + 2 × cuBLASLt 1 MiB in one 2 MiB segment
    assert "BLAS workspaces 66 MiB" in row["context_basis"]


def test_fp32_convolutions_run_on_tf32_as_cudnn_does_by_default():
    """cuDNN runs fp32 convolutions on TF32 tensor cores unless torch.backends.cudnn.allow_tf32 is turned off
    (matmuls do not: torch.backends.cuda.matmul.allow_tf32 is False)."""
    from planner.inputs.catalog import load_catalog
    from planner.models.roofline import FAST, update_seconds

    h100 = load_catalog().gpu("h100_sxm")
    rows = [("conv", "float32", 1e15, 0, 1)]
    conv = update_seconds(rows, 0, h100, tf32=False, fr=FAST, conv_tf32=True)
    assert conv == pytest.approx(1e15 / (h100.tf32_dense_tflops * 1e12 * FAST.matmul))
    off = update_seconds(rows, 0, h100, tf32=False, fr=FAST, conv_tf32=False)
    matmul = update_seconds([("matmul", "float32", 1e15, 0, 1)], 0, h100, tf32=False, fr=FAST)
    assert off == matmul == pytest.approx(1e15 / (h100.fp32_tflops * 1e12 * FAST.matmul))


def test_a_census_with_convolutions_is_found_for_its_target():
    import json

    from planner.models.overheads import has_convolutions

    prof = json.dumps({"sm80+": {"ops": [["conv", "float32", 10, 10, 1]], "launches": 1}})
    assert has_convolutions(prof, "sm80+") and not has_convolutions(prof, "sm50-75")
    assert not has_convolutions(json.dumps({"sm80+": {"ops": [["matmul", "float32", 1, 1, 1]]}}), "sm80+")


def test_pure_half_precision_is_described_on_the_tensor_cores_it_runs_on():
    """`16-true` (model.half(), as the public T5 row runs) was described as 'non-tensor fp32 (TF32 off)' while its
    fp16 matmuls were timed on the tensor-core peak: the basis must name the peak the time used."""
    from planner.inputs.catalog import load_catalog
    from planner.models.roofline import Census

    gpu = load_catalog().gpu("h100_sxm")
    census = Census("sm80+", {"ops": [["matmul", "float16", 1e12, 1e6, 1]], "launches": 1}, 1, 1, 1)
    for precision in ("16-true", "bf16-true", "fp16"):
        text = census.describe(gpu, precision)
        assert "tensor-core peak" in text and "non-tensor" not in text, (precision, text)
    assert "non-tensor fp32 (TF32 off)" in census.describe(gpu, "fp32")


def test_tile_and_wave_quantization_by_hand():
    """NVIDIA's Matrix Multiplication Background guide: 128 × 128 output tiles, one per SM per wave."""
    from planner.models.roofline import wave_efficiency

    sms = H100.sm_count
    assert sms == 132
    assert wave_efficiency([1, 128 * sms, 128, "m"], sms) == 1.0  # exactly one full wave
    assert math.isclose(wave_efficiency([1, 128 * (sms + 1), 128, "m"], sms), (sms + 1) / (2 * sms))  # a 2nd wave
    assert math.isclose(wave_efficiency([1, 100, 128, "m"], sms), 100 / 128)  # under one wave: split-K, tiles only
    assert math.isclose(wave_efficiency([2, 192, 256, "b"], sms), 2 * 192 * 256 / (2 * 2 * 2 * 128 * 128))
    assert wave_efficiency([1, 129, 129, "m"], None) == 1.0  # no sm_count in the catalog: no quantization


def test_a_gemm_one_tile_past_a_wave_takes_two_waves():
    m = 128 * H100.sm_count
    one = [("matmul", "bfloat16", 2 * m * 128 * 8192, 0, 1, [1, m, 128, "m"])]
    past = [("matmul", "bfloat16", 2 * (m + 128) * 128 * 8192, 0, 1, [1, m + 128, 128, "m"])]
    t1, t2 = (update_seconds(r, 0, H100, False, POINT) for r in (one, past))
    assert math.isclose(t2 / t1, 2.0)  # 133 tiles run as 2 waves of 132 slots
    plain = update_seconds([r[:5] for r in past], 0, H100, False, POINT)  # a census from before grids were kept
    assert math.isclose(t2 / plain, 2 * H100.sm_count / (H100.sm_count + 1))


def test_a_matmuls_grid_grows_along_its_token_axis_only():
    c = census([("matmul", "bfloat16", 10**12, 10**6, 1, [1, 1024, 4096, "m"]),
                ("matmul", "bfloat16", 10**12, 10**6, 1, [1, 4096, 4096, "-"]),
                ("matmul", "bfloat16", 10**9, 10**6, 1, [16, 512, 512, "b"])], mb=2, seq=512, accum=1)
    rows, _ = c.rows_for(micro_batch=4, seq_len=1024, grad_accum=1)
    assert [r[5] for r in rows] == [[1, 4096, 4096, "m"], [1, 4096, 4096, "-"], [32, 1024, 512, "b"]]


def test_an_fp32_conv_net_is_timed_on_a_gpu_the_catalog_gives_only_a_tf32_figure():
    import dataclasses

    nvl = dataclasses.replace(H100, fp32_tflops=None)  # a catalog entry (--catalog) with a TF32 figure only
    conv = census([["conv", "float32", 1e12, 1e6, 1]])
    assert conv.missing_peak(nvl) is None  # cuDNN runs it on TF32 (allow_tf32 on by default), which has a figure
    assert 0 < conv.seconds(nvl, 1, 1, 1, POINT) < math.inf
    off = Census("sm80+", {**conv.profile, "cudnn_allow_tf32": False}, 1, 1, 1)
    assert off.missing_peak(nvl) == "float32"
    assert census([["matmul", "float32", 1e12, 1e6, 1]]).missing_peak(nvl) == "float32"  # matmuls: TF32 off


A100 = CATALOG.gpu("a100_80gb_sxm")


def test_convolutions_take_the_fraction_of_their_precision_and_layout():
    """cuDNN's convolutions reach their own share of the tensor-core peak, by precision and layout (roofline.
    CONV_MODEL, fitted on NVIDIA's public ResNet-50 rows), not the matmul's MAMF: TF32 from the NCHW TF32 row, half
    from the channels-last AMP row, half in NCHW that share × conv_half_nchw (PyTorch's channels-last tutorial)."""
    from planner.models.roofline import conv_fraction, matmul_fraction

    assert 0 < POINT.conv_tf32 < POINT.conv_half < matmul_fraction(A100, POINT)
    assert 0 < POINT.conv_half_nchw < 1
    flops = 1e15
    tf32 = census([["conv", "float32", flops, 0, 1]]).seconds(A100, 1, 1, 1, POINT)
    assert math.isclose(tf32, flops / (A100.tf32_dense_tflops * 1e12 * POINT.conv_tf32))
    half = {fmt: Census("sm80+", {"ops": [["conv", "float16", flops, 0, 1]], "launches": 1,
                                  "conv_memory_format": fmt}, 1, 1, 1).seconds(A100, 1, 1, 1, POINT)
            for fmt in ("channels_last", "contiguous")}
    assert math.isclose(half["channels_last"], flops / (A100.fp16_dense_tflops * 1e12 * POINT.conv_half))
    assert math.isclose(half["contiguous"], half["channels_last"] / POINT.conv_half_nchw)
    # a census from before layouts were counted is NCHW, PyTorch's default
    assert census([["conv", "float16", flops, 0, 1]]).seconds(A100, 1, 1, 1, POINT) == half["contiguous"]
    # fp32 on the CUDA cores (TF32 off, or a GPU without TF32) keeps the matmul fraction
    assert conv_fraction(A100, "float32", False, "contiguous", POINT) == matmul_fraction(A100, POINT)
    assert conv_fraction(CATALOG.gpu("v100_16gb"), "float32", True, "contiguous", POINT) \
        == matmul_fraction(CATALOG.gpu("v100_16gb"), POINT)
    # the fast end stays the cited MAMF; the slow end keeps the matmul range's proportion below the point
    assert conv_fraction(A100, "float16", True, "channels_last", FAST) == FAST.matmul
    assert math.isclose(SLOW.conv_half / POINT.conv_half, SLOW.matmul / FAST.matmul)
    assert math.isclose(SLOW.conv_tf32 / POINT.conv_tf32, SLOW.matmul / FAST.matmul)


@pytest.mark.slow  # two ResNet-50 estimates at batch 256 (about a minute on 2 cores)
def test_resnet50_on_an_a100_in_tf32_and_channels_last_amp_is_timed_from_the_public_figures(tmp_path):
    """#43 item 5, the user's steps: ResNet-50 at batch 256, estimated for sm80+ and planned on an A100 80GB SXM.
    NVIDIA's DeepLearningExamples (resnet50v1.5/README.md, 1 × A100 80GB): 938 img/s in TF32 (273 ms a step; NCHW)
    and 2470 img/s in mixed precision (104 ms; channels-last, configs.yml). The plan said 131–221 ms for TF32."""
    from planner.decisions.pipeline import make_plan
    from planner.ledger import read_lines
    from planner.records import ProbeConfig
    from probes.runner import run_grid
    from tests.test_recommendations import campaign

    ref = "tests/workloads.py:resnet50_like"
    rows = {"fp32": ("contiguous", 0.2729), "fp16": ("channels_last", 0.1036)}
    for precision, (fmt, real_s) in rows.items():
        params = {"memory_format": fmt}
        path = str(tmp_path / f"{precision}.db")
        run_grid([ProbeConfig(workload=ref, params_json=json.dumps(params, sort_keys=True), micro_batch=256,
                              seq_len=224, eval_seq_len=224, eval_micro_batch=256, precision=precision,
                              optimizer="sgd", mode="estimated", target="sm80+")], path, progress=lambda m: None)
        lines = read_lines(path)
        steady = lines[lines["phase"] == "steady"].iloc[0]
        assert json.loads(steady["op_profile_json"])["sm80+"]["conv_memory_format"] == fmt  # on the ledger line
        spec = campaign(workload=ref, params=params, precision=precision, optimizer="sgd", seq_len=224,
                        effective_batch=256, eval={"every_updates": 50, "examples": 256, "seq_len": 224})
        sheet = make_plan(spec, lines, CATALOG).sheet
        row = sheet[sheet["offer"] == "runpod-a100_80gb_sxm-1x"].iloc[0]
        assert row["micro_batch"] == 256
        low, point, high = row["update_s_low"], row["update_s_point"], row["update_s_high"]
        assert low <= real_s <= high, (precision, low, real_s, high)
        assert abs(point / real_s - 1) < 0.15, (precision, point, real_s)
        basis = row["time_basis"]
        assert ("channels-last" if fmt == "channels_last" else "NCHW") in basis, basis
