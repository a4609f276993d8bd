"""Seconds per update on a GPU from the census of one update's ops (probes/census.py), op by op.

Each op takes the longest of: its FLOPs at the peak of its unit and dtype × the fraction such kernels
achieve; its bytes at the memory bandwidth × the fraction achieved; one kernel launch. The update is the
sum over ops (every extra launch of a foreach op adds a launch). Three sets of fractions give the fast end,
the point estimate and the slow end; plans use the slow end.

Peaks: bf16/fp16 from the catalog's dense tensor-core figures; fp32 matmuls run on the non-tensor fp32 peak
unless the workload enabled TF32 (torch.backends.cuda.matmul.allow_tf32 is False by default since 1.12;
the census reads whichever of the legacy and fp32_precision APIs is in force, probes/census.precision_flags, and
records the legacy name: "highest" = no TF32); fp32 convolutions run on the
TF32 tensor-core peak, as cuDNN does by default (torch.backends.cudnn.allow_tf32 is True; PyTorch's
docs/source/notes/cuda.rst, "TensorFloat-32 (TF32) on Ampere (and later) devices"; the census records it).

Fractions and their sources:
- convolution on the tensor cores (cuDNN's implicit GEMMs, with the transposes an NCHW tensor costs and the weight
  gradients): its own share by precision and layout (CONV_MODEL below), fitted on NVIDIA's public ResNet-50 rows
  and PyTorch's channels-last tutorial; the fast end keeps the matmul's MAMF; fp32 on the CUDA cores keeps the
  matmul fractions.
- matmul: stas00's maximum achievable matmul FLOPS (MAMF), 80–87 % of peak on NVIDIA parts (A100 SXM 86.9 %,
  H100 SXM 80.3 %, stas00/ml-engineering compute/accelerator/README.md); per GPU from the catalog's
  `mamf_bf16_tflops` where it has one. The slow end, 50 %, is for the smaller shapes a step also runs
  (MAMF is the best shape found by a search; no published per-shape figure is used here).
- attention (flash / memory-efficient): FlashAttention-2 reaches 50–73 % of peak on A100 (Dao, 2023,
  arXiv:2307.08691 abstract); on H100 FlashAttention-2 reaches 35 % and FlashAttention-3 75 % (Shah et al.,
  2024, arXiv:2407.08608): the sm90+ range spans both, since PyTorch may run either FA2 or cuDNN attention.
- depthwise convolutions (groups == input channels, PyTorch's ConvParams::is_depthwise) run as per-channel
  kernels on the CUDA cores: the fp32 peak × the matmul fraction, whatever the dtype.
- tile and wave quantization: a matmul's output grid (the census records it) runs as 128 × 128 tiles in waves
  of one per SM (NVIDIA's Matrix Multiplication Background User's Guide); its FLOP time is divided by the share
  of launched tile work that is its own (wave_efficiency).
- causal attention: the census counts the unmasked share of the scores (probes/census.attention_flops).
- memory-bound ops and the launch cost: no published figure was found for these; the range used (55–92 %
  of the bandwidth, 5–10 µs a launch) is an assumption that benchmarks/gpu_check.sh measures on the first
  lent GPU (achieved copy bandwidth and the eager per-op time are printed there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from planner.catalog_records import Gpu

MAMF_DEFAULT = 0.80  # stas00: H100 SXM 80.3 %, the lower of the NVIDIA figures


@dataclass(frozen=True)
class Fractions:
    name: str
    matmul: float | None  # None: the GPU's MAMF fraction × of_mamf
    attention_sm80: float
    attention_sm90: float
    memory: float
    launch_s: float
    of_mamf: float = 1.0
    # cuDNN convolutions on the tensor cores (planner/models/roofline.conv_fraction): the share of the TF32 / half
    # peak reached, and the factor an NCHW half-precision conv takes of it; None: the matmul fraction (the cited MAMF)
    conv_tf32: float | None = None
    conv_half: float | None = None
    conv_half_nchw: float = 1.0


# The point estimate is calibrated on the public H100 rows (benchmarks/gpu-truth/h100.csv, 15 training runs of 7
# models): real = k_compute × (matmul + attention + conv time) + k_memory × (memory-bound time) + launches, fitted
# by least squares on relative error, gives k_compute 1.082 and k_memory 1.395 (benchmarks/gpu_truth.py --fit
# prints them and the leave-one-out errors, each row predicted by the fit of the other 14: 15 of 15 within 15 %,
# median 1.2 %; uncalibrated, 4 of 15 and 19 %). As fractions: matmuls and attention at 1 / 1.082 = 92 % of what
# MAMF and the FlashAttention papers give (after tile and wave quantization), memory-bound ops at 0.85 / 1.395 =
# 61 % of the bandwidth (small elementwise kernels, autocast casts and foreach optimizer steps reach less than a
# streaming copy). The fast and slow ends stay the cited figures, the slow end's bandwidth widened to hold the
# calibrated point.
CALIBRATED_ON = "the public H100 runs (gpu-truth, 15 rows; leave-one-out 15 of 15 within 15 %)"

# CONV_MODEL: the share of the tensor-core peak cuDNN's convolutions reach in a training step (forward, data and
# weight gradients together), by precision and layout. The matmul's MAMF overstates it: ResNet-50 at batch 256 on
# one A100 80GB trains at 938 img/s in TF32 (273 ms a step) and 2470 img/s in mixed precision (104 ms)
# (NVIDIA/DeepLearningExamples @ 729963dd, PyTorch/Classification/ConvNets/resnet50v1.5/README.md:598; the mixed-
# precision run is channels-last, the TF32 one NCHW: ConvNets/configs.yml:152-161), where the MAMF fractions planned
# 182 ms and 93 ms. Solved so that the point meets each (benchmarks/conv_truth.py --fit, with the memory-bound ops
# at the point's bandwidth fraction):
# - conv_tf32: fp32 convolutions on the TF32 tensor cores (cudnn.allow_tf32, PyTorch's default), from the TF32 row
#   (NCHW; no public channels-last TF32 figure was found, so a channels-last TF32 run is given the same share);
# - conv_half: fp16/bf16 convolutions in channels-last (NHWC, cuDNN's native tensor-core layout), from the AMP row;
# - conv_half_nchw: the factor an NCHW half-precision convolution takes of conv_half (cuDNN transposes around it),
#   from PyTorch's channels-last tutorial (pytorch/tutorials intermediate_source/memory_format_tutorial.py,
#   "Performance Gains": ResNet-50, batch 200, apex AMP, Volta: 0.259 s a step in NCHW, 0.198 s in channels-last),
#   solved so that the two steps' ratio (1.31) is met on a V100 16GB.
# The other public rows of benchmarks/conv-truth/public.csv (ResNeXt-101 and SE-ResNeXt-101 on the A100, all three
# models on the V100) are held out. The fast end keeps the cited MAMF fractions (cuDNN's best implicit GEMMs); the
# slow end keeps the matmul range's proportion below the point (0.50 / 0.87).
CONV_TF32, CONV_HALF, CONV_HALF_NCHW = 0.259, 0.520, 0.536
CONV_SLOW = 0.50 / 0.87
FAST = Fractions("fast end", 0.87, 0.73, 0.75, 0.92, 5e-6)
POINT = Fractions("point", None, 0.60 / 1.082, 0.50 / 1.082, 0.85 / 1.395, 7e-6, of_mamf=1 / 1.082,
                  conv_tf32=CONV_TF32, conv_half=CONV_HALF, conv_half_nchw=CONV_HALF_NCHW)
SLOW = Fractions("slow end", 0.50, 0.50, 0.35, 0.55, 10e-6, conv_tf32=CONV_TF32 * CONV_SLOW,
                 conv_half=CONV_HALF * CONV_SLOW, conv_half_nchw=CONV_HALF_NCHW)


def peak_tflops(gpu: Gpu, dtype: str, tf32: bool) -> float | None:
    if dtype == "bfloat16":
        return gpu.bf16_dense_tflops
    if dtype == "float16":
        return gpu.fp16_dense_tflops
    if tf32 and gpu.tf32_dense_tflops:
        return gpu.tf32_dense_tflops
    return gpu.fp32_tflops


def conv_fraction(gpu: Gpu, dtype: str, tf32: bool, layout: str, fr: Fractions) -> float:
    """The share of the tensor-core peak cuDNN's convolutions reach in a training step (forward, data and weight
    gradients together), by precision and layout (CONV_MODEL); fp32 on the CUDA cores (TF32 off, or a GPU
    without TF32) keeps the matmul fraction."""
    if dtype in ("bfloat16", "float16") and fr.conv_half is not None:
        return fr.conv_half * (1.0 if layout == "channels_last" else fr.conv_half_nchw)
    if dtype == "float32" and tf32 and gpu.tf32_dense_tflops and fr.conv_tf32 is not None:
        return fr.conv_tf32
    return matmul_fraction(gpu, fr)


def matmul_fraction(gpu: Gpu, fr: Fractions) -> float:
    if fr.matmul is not None:
        return fr.matmul
    if gpu.mamf_bf16_tflops and gpu.bf16_dense_tflops:
        return gpu.mamf_bf16_tflops / gpu.bf16_dense_tflops * fr.of_mamf
    return MAMF_DEFAULT * fr.of_mamf


def scale_rows(profile: dict, token_ratio: float, seq_ratio: float, accum_ratio: float) -> list:
    """The census of one update at another shape: per-micro-batch ops scale with tokens per micro-batch (attention
    FLOPs also with seq_len) and their count with the accumulation; optimizer (foreach) ops stay as they are.
    A matmul's grid grows along its token axis: M ("m"), or a bmm's batch with the micro-batch and M with seq_len;
    a recurrent step's ("r") M grows with the micro-batch and its count with seq_len."""
    rows = []
    for kind, dtype, flops, nbytes, count, *grid in profile["ops"]:
        if kind == "foreach":
            rows.append((kind, dtype, flops, nbytes, count))
            continue
        step = bool(grid) and isinstance(grid[0], (list, tuple)) and len(grid[0]) == 4 and grid[0][3] == "r"
        per_op = token_ratio / seq_ratio if step else token_ratio  # a recurrent step: the steps are the count
        f = flops * per_op * (seq_ratio if kind == "attention" else 1.0)
        rows.append((kind, dtype, f, nbytes * per_op, count * accum_ratio * (seq_ratio if step else 1.0),
                     *[scale_grid(g, token_ratio, seq_ratio) for g in grid]))
    return rows


def scale_grid(grid, token_ratio: float, seq_ratio: float):
    if not isinstance(grid, (list, tuple)) or len(grid) != 4:
        return None
    b, m, n, axis = grid
    if axis == "m":
        return [b, max(1, round(m * token_ratio)), n, axis]
    if axis == "b":
        return [max(1, round(b * token_ratio / seq_ratio)), max(1, round(m * seq_ratio)), n, axis]
    if axis == "r":  # one step of a recurrent layer: M is the micro-batch (its count is the steps)
        return [b, max(1, round(m * token_ratio / seq_ratio)), n, axis]
    return list(grid)


# Tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, sections
# "Tile Quantization" and "Wave Quantization"): a GEMM runs as output tiles, each on one SM, in waves of one tile
# per SM; a partial tile or a partial last wave costs what a full one does. 128 × 128 is the guide's and cuBLAS's
# common tile for large half-precision GEMMs. A grid of fewer tiles than SMs is taken as split along K
# (cuBLAS's split-K / stream-K kernels fill the GPU there), so only its tile quantization counts. A GPU whose
# catalog entry has no sm_count gets no quantization (said in the time basis).
TILE_M, TILE_N = 128, 128


def wave_efficiency(grid, sm_count: int | None) -> float:
    """The share of the launched tiles' work that is the GEMM's own: 1 when it fills whole tiles and waves."""
    if not sm_count or not isinstance(grid, (list, tuple)) or len(grid) != 4:
        return 1.0
    b, m, n = (int(x) for x in grid[:3])
    if min(b, m, n) < 1:
        return 1.0
    tiles = b * -(-m // TILE_M) * -(-n // TILE_N)
    slots = tiles if tiles < sm_count else -(-tiles // sm_count) * sm_count
    return b * m * n / (slots * TILE_M * TILE_N)


def op_seconds(row, gpu: Gpu, tf32: bool, fr: Fractions, conv_tf32: bool = True,
               conv_layout: str = "contiguous") -> tuple[float, str]:
    """One op's seconds (one launch of it) and what bounds it: "compute", "memory" or "launch"; nan when the
    catalog lacks the GPU's peak for the op's dtype."""
    kind, dtype, flops, nbytes, _count, *grid = row
    t_mem = nbytes / (gpu.mem_bandwidth_tbps * 1e12 * fr.memory)
    t_compute = 0.0
    if flops and kind == "depthwise":  # per-channel kernels on the CUDA cores, not implicit GEMMs
        if not gpu.fp32_tflops:
            return float("nan"), "compute"
        t_compute = flops / (gpu.fp32_tflops * 1e12 * matmul_fraction(gpu, fr))
    elif flops and kind in ("matmul", "attention", "conv"):
        peak = peak_tflops(gpu, dtype, conv_tf32 if kind == "conv" else tf32)
        if not peak:
            return float("nan"), "compute"  # the catalog lacks this GPU's peak for the dtype: no time, said so
        if kind == "attention":
            share = fr.attention_sm90 if (gpu.sm() or 0) >= 9 else fr.attention_sm80
        elif kind == "conv":
            share = conv_fraction(gpu, dtype, conv_tf32, conv_layout, fr)
        else:
            share = matmul_fraction(gpu, fr)
        t_compute = flops / (peak * 1e12 * share)
        if kind == "matmul" and grid:
            t_compute /= wave_efficiency(grid[0], gpu.sm_count)
    t = max(t_mem, t_compute, fr.launch_s)
    return t, "compute" if t == t_compute else "memory" if t == t_mem else "launch"


def update_seconds(rows, extra_launches: float, gpu: Gpu, tf32: bool, fr: Fractions, conv_tf32: bool = True,
                   conv_layout: str = "contiguous") -> float:
    total = 0.0
    for row in rows:
        total += row[4] * op_seconds(row, gpu, tf32, fr, conv_tf32, conv_layout)[0]
    return total + extra_launches * fr.launch_s


@dataclass(frozen=True)
class Census:
    """One update's ops for one kernel target, at the shape it was counted at."""

    target: str
    profile: dict
    micro_batch: int
    seq_len: int
    grad_accum: int

    def for_precision(self, precision: str) -> "Census":
        """The census as the planned precision runs it: autocast's half dtype is bf16 or fp16 by the plan (a
        bf16 census planned on a V100 runs fp16 there), the same ops and bytes."""
        half = {"fp16": "float16", "16-true": "float16", "bf16": "bfloat16", "bf16-true": "bfloat16"}.get(precision)
        if half is None:
            return self
        ops = [[k, half if d in ("float16", "bfloat16") else d, *rest] for k, d, *rest in self.profile["ops"]]
        return Census(self.target, {**self.profile, "ops": ops}, self.micro_batch, self.seq_len, self.grad_accum)

    def missing_peak(self, gpu: Gpu) -> str | None:
        """The dtype whose peak the catalog lacks for this GPU (the census then gives no time), or None."""
        for kind, dtype, flops, *_ in self.profile["ops"]:
            tf32 = self.conv_tf32 if kind == "conv" else self.tf32  # the peak op_seconds will time it at
            if flops and kind in ("matmul", "attention", "conv") and not peak_tflops(gpu, dtype, tf32):
                return dtype
            if flops and kind == "depthwise" and not gpu.fp32_tflops:
                return "float32"
        return None

    @property
    def tf32(self) -> bool:
        return self.profile.get("float32_matmul_precision", "highest") != "highest"

    @property
    def conv_tf32(self) -> bool:
        return bool(self.profile.get("cudnn_allow_tf32", True))  # PyTorch's default

    @property
    def conv_layout(self) -> str:
        """The layout cuDNN ran most of the convolutions' work in (probes/census.py); NCHW where not counted."""
        return self.profile.get("conv_memory_format", "contiguous")

    def rows_for(self, micro_batch: int, seq_len: int, grad_accum: int) -> tuple[list, float]:
        tokens = (micro_batch * seq_len) / (self.micro_batch * self.seq_len)
        accum = grad_accum / self.grad_accum
        rows = scale_rows(self.profile, tokens, seq_len / self.seq_len, accum)
        ops = sum(r[4] for r in self.profile["ops"])
        extra = max(0.0, self.profile["launches"] - ops)  # foreach ops launch more than once
        return rows, extra

    def seconds(self, gpu: Gpu, micro_batch: int, seq_len: int, grad_accum: int, fr: Fractions) -> float:
        rows, extra = self.rows_for(micro_batch, seq_len, grad_accum)
        return update_seconds(rows, extra, gpu, self.tf32, fr, self.conv_tf32, self.conv_layout)

    def _conv_note(self, gpu: Gpu, dtype: str) -> str:
        if not any(r[0] == "conv" for r in self.profile["ops"]):
            return ""
        layout = "channels-last" if self.conv_layout == "channels_last" else "NCHW"
        name = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, "float32")
        shares = [conv_fraction(gpu, name, self.conv_tf32, self.conv_layout, fr) for fr in (SLOW, FAST, POINT)]
        if name != "float32":
            unit = "that tensor-core peak"
        else:
            peak = peak_tflops(gpu, "float32", self.conv_tf32)
            tensor = self.conv_tf32 and gpu.tf32_dense_tflops
            unit = (f"the {'TF32 tensor-core' if tensor else 'fp32'} peak "
                    f"{'(not in the catalog)' if peak is None else f'{peak:g} TFLOPS'} (cudnn.allow_tf32)")
            if not tensor:  # on the CUDA cores: the matmul fractions
                return f", {layout} convolutions at the same fractions of {unit}"
        return (f", {layout} convolutions at {shares[0]:.0%}–{shares[1]:.0%} of {unit}, the point at {shares[2]:.0%} "
                f"(cuDNN in NVIDIA's public ResNet-50 steps, by precision and layout)")

    def _depthwise_note(self, gpu: Gpu) -> str:
        if not any(r[0] == "depthwise" for r in self.profile["ops"]):
            return ""
        return (f", depthwise convolutions at the same fractions of the fp32 CUDA-core peak "
                f"{'(not in the catalog)' if not gpu.fp32_tflops else f'{gpu.fp32_tflops:g} TFLOPS'}")

    def describe(self, gpu: Gpu, dtype: str) -> str:
        dtype = {"16-true": "fp16", "bf16-true": "bf16"}.get(dtype, dtype)  # pure half runs the same tensor cores
        n = sum(r[4] for r in self.profile["ops"])
        peak = peak_tflops(gpu, {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, "float32"), self.tf32)
        unit = "tensor-core" if dtype in ("bf16", "fp16") or self.tf32 else "non-tensor fp32 (TF32 off)"
        return (f"per-op roofline over {n} ops of one update ({self.target} kernels): matmuls at "
                f"{SLOW.matmul:.0%}–{FAST.matmul:.0%} of {gpu.id}'s {unit} peak "
                f"{'(not in the catalog)' if peak is None else f'{peak:g} TFLOPS'} (MAMF), "
                + (f"in 128×128 tiles and waves over its {gpu.sm_count} SMs (NVIDIA's GEMM guide)" if gpu.sm_count
                   else "no tile or wave count (the catalog has no sm_count for it)")
                + f"{self._conv_note(gpu, dtype)}{self._depthwise_note(gpu)}, attention "
                f"{SLOW.attention_sm80:.0%}–{FAST.attention_sm80:.0%} (sm80) / {SLOW.attention_sm90:.0%}–"
                f"{FAST.attention_sm90:.0%} (sm90+) (FlashAttention-2/3 papers), memory-bound ops at "
                f"{SLOW.memory:.0%}–{FAST.memory:.0%} of {gpu.mem_bandwidth_tbps:g} TB/s and 5–10 µs a launch "
                f"(assumed until gpu_check measures them); the point at {POINT.of_mamf:.0%} of those compute "
                f"fractions and {POINT.memory:.0%} of the bandwidth, calibrated on {CALIBRATED_ON}")


def census_for(op_profile_json: str | None, target: str, micro_batch: int, seq_len: int,
               grad_accum: int) -> Census | None:
    """The census of `target` from a steady line's op_profile_json (another target's when it has none)."""
    if not op_profile_json:
        return None
    try:
        profiles = json.loads(op_profile_json)
    except (TypeError, ValueError):
        return None
    usable = {t: p for t, p in profiles.items() if isinstance(p, dict) and "ops" in p}
    if not usable:
        return None
    name = target if target in usable else sorted(usable)[0]
    return Census(name, usable[name], micro_batch, seq_len, grad_accum)
