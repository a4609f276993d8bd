"""The achieved fractions the per-op time model assumes (planner/models/roofline.py), measured on the GPU at hand.

    python benchmarks/gpu_calibration.py [--out figures.json]

Prints, against the catalog's figures for the matched GPU: copy and elementwise bandwidth, the eager
per-op time of tiny ops (the launch cost), bf16 and fp32 (TF32 off) matmul TFLOPS, and SDPA (flash)
forward+backward TFLOPS. Each is a median of timed repetitions after a warm-up, synchronized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(fn, reps: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from planner.inputs.catalog import load_catalog
    from planner.models.timing import match_catalog_gpu

    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}): nothing to calibrate")
        return
    gpu = match_catalog_gpu(torch.cuda.get_device_name(0), load_catalog())
    dev = "cuda"
    n = 256 * 2**20  # 1 GiB of fp32
    x, y = torch.empty(n, device=dev), torch.empty(n, device=dev)
    copy_s = timed(lambda: y.copy_(x))
    add_s = timed(lambda: torch.add(x, x, out=y))
    tiny = torch.ones(16, device=dev)

    def many():
        for _ in range(1000):
            tiny.add_(1.0)

    per_op = timed(many, 5) / 1000
    figures = {"gpu": torch.cuda.get_device_name(0), "catalog_gpu": gpu.id if gpu else None,
               "copy_tbps": 2 * 4 * n / copy_s / 1e12, "add_tbps": 3 * 4 * n / add_s / 1e12,
               "eager_op_us": per_op * 1e6}
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        torch.backends.cuda.matmul.allow_tf32 = False
        a = torch.randn(8192, 8192, device=dev, dtype=dtype)
        s = timed(lambda a=a: a @ a, 5)
        figures[f"matmul_{key}_tflops"] = 2 * 8192**3 / s / 1e12
    q, k, v = (torch.randn(8, 16, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1).sum().backward()

    att_s = timed(attention, 5)
    flops = 4 * 8 * 16 * 2048 * 2048 * 128 * 3.5 / 2  # fwd 4·b·h·s²·d (÷2 causal), bwd 2.5× fwd
    figures["sdpa_fwd_bwd_tflops"] = flops / att_s / 1e12
    if gpu is not None:
        figures["fractions"] = {
            "memory (copy)": figures["copy_tbps"] / gpu.mem_bandwidth_tbps,
            "memory (add)": figures["add_tbps"] / gpu.mem_bandwidth_tbps,
            "matmul bf16": figures["matmul_bf16_tflops"] / (gpu.bf16_dense_tflops or float("nan")),
            "matmul fp32": figures["matmul_fp32_tflops"] / (gpu.fp32_tflops or float("nan")),
            "attention bf16": figures["sdpa_fwd_bwd_tflops"] / (gpu.bf16_dense_tflops or float("nan"))}
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
