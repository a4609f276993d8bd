#!/usr/bin/env bash
# Every CUDA test and GPU benchmark, in under 8 minutes; figures go to one file.
#   bash benchmarks/gpu_check.sh [FIGURES_FILE]        (default: gpu-figures.txt)
# Runs from the checkout with the machine's own python3 (PYTHONPATH=.), so it needs no install:
# torch, pandas, jinja2, click, tabulate, PyYAML, safetensors, transformers, pytest must be importable.
# Budget (timeouts): tests 120 s, estimate-vs-measured 270 s, calibration 40 s, demo 45 s = 475 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-figures.txt}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: > "$OUT"
section() { printf '\n== %s ==\n' "$1" | tee -a "$OUT"; }

section "machine"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"; } \
  2>&1 | tee -a "$OUT"

section "pytest -m gpu (CUDA tests)"
timeout 120 "$PY" -m pytest -m gpu -q -s tests/test_gpu.py 2>&1 | tail -25 | tee -a "$OUT"

section "estimate vs measured on this GPU (allocated, need vs reserved, update time) + allocator traces"
timeout 270 "$PY" benchmarks/gpu_vs_estimate.py --device cuda --out gpu-vs-estimate.json 2>&1 \
  | grep -v Warning | tail -45 | tee -a "$OUT"

section "calibration of the time model's fractions (bandwidth, launch, matmul, attention)"
timeout 40 "$PY" benchmarks/gpu_calibration.py 2>&1 | tail -25 | tee -a "$OUT"

section "demo on cuda"
TMP=$(mktemp -d)
( cd "$TMP" && timeout 45 "$PY" -m planner demo --device cuda 2>&1 | tail -25 ) | tee -a "$OUT"
rm -rf "$TMP"
echo "figures written to $OUT (and gpu-vs-estimate.json)"
