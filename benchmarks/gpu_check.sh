#!/usr/bin/env bash
# Every CUDA test and GPU benchmark, in under 8 minutes; figures go to one file.
#   bash benchmarks/gpu_check.sh [FIGURES_FILE]        (default: gpu-figures.txt)
# Runs from the checkout with the machine's own python3 (PYTHONPATH=.), so it needs no install:
# torch, pandas, jinja2, click, tabulate, PyYAML, safetensors, pytest must already be importable.
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
timeout 240 "$PY" -m pytest -m gpu -q -s tests/test_gpu.py 2>&1 | tail -25 | tee -a "$OUT"

section "probe overhead on cuda (12 configurations)"
timeout 150 "$PY" benchmarks/probe_overhead.py --device cuda 2>&1 | tail -20 | tee -a "$OUT"

section "demo on cuda"
TMP=$(mktemp -d)
( cd "$TMP" && timeout 90 "$PY" -m planner demo --device cuda 2>&1 | tail -25 ) | tee -a "$OUT"
rm -rf "$TMP"
echo "figures written to $OUT"
