"""rentplan's convolution time against public ConvNet training throughput (benchmarks/conv-truth/public.csv).

    .venv-bench/bin/python benchmarks/conv_truth.py [--fit] [--rows TAG,TAG] [--out figures.json]

The rows are single-GPU training throughputs nobody here measured: NVIDIA's DeepLearningExamples READMEs
(NVIDIA/DeepLearningExamples @ 729963dd, PyTorch/Classification/ConvNets/{resnet50v1.5,resnext101-32x4d,
se-resnext101-32x4d}/README.md, "Training performance results", 1 GPU; pytorch-21.03 NGC container; batch sizes and
memory formats from ConvNets/configs.yml: mixed precision ran channels-last (`memory_format: nhwc`), TF32 and FP32
did not) and the ResNet-50 pair of PyTorch's channels-last tutorial (pytorch/tutorials
intermediate_source/memory_format_tutorial.py, "Performance Gains": apex AMP O2, batch 200, 0.259 s a step in NCHW
against 0.198 s in channels-last, on Volta). step_ms = micro_batch / img_per_s.

Each (model, precision, memory format) is counted once under fake tensors (probes/census.py, the census a
`rentplan estimate` line carries: timm's model with `pretrained=False`, random images, cross-entropy, SGD) and timed
on the row's catalog GPU by the planner's per-op roofline (planner/models/roofline.py) at the row's batch: the fast
end, the point and the slow end, and the point as it was before the convolution model (every conv at the matmul
fractions).

--fit solves the convolution model's three point figures (roofline.CONV_MODEL) from the rows that calibrate them:
conv_tf32 so that the point meets rn50-a100-tf32, conv_half so that it meets rn50-a100-amp, conv_half_nchw so that
the tutorial's NCHW/NHWC step ratio is met; every other row is held out.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.records import ProbeConfig  # noqa: E402

TRUTH = ROOT / "benchmarks" / "conv-truth" / "public.csv"
WORKLOAD = f"{ROOT / 'benchmarks' / 'truth_workloads.py'}:truth"


def count(model: str, precision: str, memory_format: str, micro_batch: int, target: str) -> dict:
    """The census of one steady update of timm's `model` (fake tensors, `target`'s kernels)."""
    from probes.census import census
    from probes.kernels import target_kernels
    from probes.workloads import load_workload

    params = {"kind": "timm", "source": model, "memory_format": memory_format}
    cfg = ProbeConfig(workload=WORKLOAD, params_json=json.dumps(params, sort_keys=True), micro_batch=micro_batch,
                      seq_len=224, eval_seq_len=224, eval_micro_batch=micro_batch, precision=precision,
                      optimizer="sgd", device="cpu", mode="estimated", target=target)
    return census(load_workload(WORKLOAD, params), cfg, lambda: target_kernels(target))


def times(profile: dict, row: dict, fractions) -> list[float]:
    from planner.inputs.catalog import load_catalog
    from planner.models.roofline import Census

    gpu = load_catalog().gpu(row["gpu"])
    mb = int(row["micro_batch"])
    c = Census("census", profile, mb, 224, 1).for_precision(row["precision"])
    return [c.seconds(gpu, mb, 224, 1, fr) for fr in fractions]


def solve(f, target: float, lo: float = 0.01, hi: float = 1.0) -> float:
    """The fraction x in [lo, hi] with f(x) = target, f decreasing in x (bisection)."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo + hi) / 2


def fit(rows: list[dict], profiles: dict) -> dict:
    from planner.models.roofline import POINT

    by = {r["tag"]: r for r in rows}

    def point(tag, **conv):
        r = by[tag]
        return times(profiles[r["key"]], r, [dataclasses.replace(POINT, **conv)])[0]

    tf32 = solve(lambda x: point("rn50-a100-tf32", conv_tf32=x), float(by["rn50-a100-tf32"]["step_ms"]) / 1e3)
    half = solve(lambda x: point("rn50-a100-amp", conv_half=x), float(by["rn50-a100-amp"]["step_ms"]) / 1e3)
    ratio = float(by["rn50-v100-amp-nchw"]["step_ms"]) / float(by["rn50-v100-amp-nhwc"]["step_ms"])
    nhwc = point("rn50-v100-amp-nhwc", conv_half=half)
    nchw = solve(lambda x: point("rn50-v100-amp-nchw", conv_half=half, conv_half_nchw=x) / nhwc, ratio, 0.05, 1.0)
    return {"conv_tf32": tf32, "conv_half": half, "conv_half_nchw": nchw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--truth", default=str(TRUTH))
    ap.add_argument("--rows", default="", help="comma-separated tags (default: every row)")
    ap.add_argument("--fit", action="store_true", help="solve the convolution model's point figures")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--censuses", default=None, help="keep the censuses in this JSON file and reuse them (a rerun "
                                                      "after a change to the planner's time model only)")
    args = ap.parse_args()
    try:
        import timm  # noqa: F401
    except ImportError:
        sys.exit("Error: timm is not installed: run make bench-truth (it builds .venv-bench), then this with it")
    from tabulate import tabulate

    from planner.inputs.catalog import load_catalog
    from planner.models.kernels import kernel_target
    from planner.models.roofline import FAST, POINT, SLOW

    with open(args.truth) as f:
        rows = list(csv.DictReader(f))
    if args.rows:
        rows = [r for r in rows if r["tag"] in set(args.rows.split(",")) or args.fit]
    catalog = load_catalog()
    kept = Path(args.censuses) if args.censuses else None
    saved = json.loads(kept.read_text()) if kept and kept.exists() else {}
    profiles = {}
    for r in rows:
        gpu = catalog.gpu(r["gpu"])
        target = kernel_target(gpu.compute_capability, gpu.software)
        r["key"] = (r["model"], r["precision"], r["memory_format"], int(r["micro_batch"]), target)
        name = "/".join(map(str, r["key"]))
        if r["key"] not in profiles and name in saved:
            profiles[r["key"]] = saved[name]
        if r["key"] not in profiles:
            print(f"{r['tag']}: counting {r['model']} ({r['precision']}, {r['memory_format']})", file=sys.stderr)
            profiles[r["key"]] = saved[name] = count(r["model"], r["precision"], r["memory_format"],
                                                     int(r["micro_batch"]), target)
    if kept:
        kept.write_text(json.dumps(saved))
    fitted = fit(rows, profiles) if args.fit else None
    before = dataclasses.replace(POINT, conv_tf32=None, conv_half=None, conv_half_nchw=1.0)
    out, table = [], []
    for r in rows:
        step = float(r["step_ms"]) / 1e3
        lo, point, hi, old = times(profiles[r["key"]], r, [FAST, POINT, SLOW, before])
        layout = profiles[r["key"]].get("conv_memory_format", "")
        out.append({"tag": r["tag"], "role": r["role"], "step_ms": step * 1e3, "low_ms": lo * 1e3,
                    "point_ms": point * 1e3, "high_ms": hi * 1e3, "before_point_ms": old * 1e3,
                    "before_error": old / step - 1, "point_error": point / step - 1, "inside": lo <= step <= hi,
                    "census_layout": layout})
        table.append([r["tag"], r["gpu"], f"{r['precision']} {r['memory_format']}", r["role"], f"{step * 1e3:.0f}",
                      f"{old * 1e3:.0f} ({old / step - 1:+.0%})", f"{lo * 1e3:.0f}–{hi * 1e3:.0f}",
                      f"{point * 1e3:.0f} ({point / step - 1:+.0%})", "yes" if lo <= step <= hi else "no"])
    print(f"rentplan vs {args.truth} (censuses: fake tensors, timm models; times: catalog.yaml GPUs)\n")
    print(tabulate(table, headers=["row", "gpu", "precision layout", "role", "public ms", "before point",
                                   "planned ms", "point", "inside"]))
    held = [o for o in out if o["role"] == "held out"]
    if held:
        print(f"\nheld out ({len(held)} rows): median |error| before "
              f"{statistics.median(abs(o['before_error']) for o in held):.1%}"
              f", after {statistics.median(abs(o['point_error']) for o in held):.1%}; inside the range "
              f"{sum(o['inside'] for o in held)} of {len(held)}")
    if fitted:
        print("\nfit: " + ", ".join(f"{k} {v:.3f}" for k, v in fitted.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": out, "fit": fitted}, indent=2))


if __name__ == "__main__":
    main()
