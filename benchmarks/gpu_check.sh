#!/usr/bin/env bash
# Every CUDA test and GPU benchmark, in under 8 minutes; every figure goes to one file.
#   bash benchmarks/gpu_check.sh [FIGURES_FILE]   (default: $OUT/gpu-figures.txt where $OUT is set, else gpu-figures.txt)
# Runs from the checkout with the machine's own python3 (PYTHON=... to choose another) and never installs torch or
# anything into that Python: rentplan's pure-Python dependencies the GPU image lacks (pydantic) come from
# .wheelhouse (`make wheelhouse` on a machine with a package index; carry it along with the checkout), unpacked
# into a temporary folder on PYTHONPATH. Imports are checked first, and each section says what is missing.
# Budget (timeouts): GPU tests 90 s, CUDA-build paths 120 s, estimate-vs-measured 180 s, calibration 30 s,
# demo 45 s = 465 s.
set -uo pipefail
cd "$(dirname "$0")/.."
FIGURES="${1:-${OUT:+$OUT/}gpu-figures.txt}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: > "$FIGURES"
section() { printf '\n== %s ==\n' "$1" | tee -a "$FIGURES"; }
NEEDED="torch numpy pandas jinja2 click tabulate yaml pydantic safetensors pytest"
missing() { "$PY" -c "import importlib.util as u, sys; print(' '.join(n for n in sys.argv[1:] if u.find_spec(n) is None))" $NEEDED; }

section "imports"
if ! command -v "$PY" >/dev/null; then echo "no $PY on this machine: PYTHON=/path/to/python3 bash $0" | tee -a "$FIGURES"; exit 1; fi
lacking=$(missing)
if [ -n "$lacking" ] && ls .wheelhouse/*.whl >/dev/null 2>&1; then
  DEPS=$(mktemp -d)
  trap 'rm -rf "$DEPS"' EXIT
  # A wheel is a zip of the package's files: unpacked on PYTHONPATH it imports as installed (compiled ones too,
  # built for this Python and platform by make wheelhouse); the machine's Python stays as it is.
  "$PY" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" "$DEPS" .wheelhouse/*.whl
  export PYTHONPATH="$PWD:$DEPS${PYTHONPATH#$PWD}"
  echo "from .wheelhouse: $(cd .wheelhouse && ls *.whl | tr '\n' ' ')" | tee -a "$FIGURES"
  lacking=$(missing)
fi
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda)" 2>&1 | tee -a "$FIGURES"
if [ -n "$lacking" ]; then
  echo "missing: $lacking. Run \`make wheelhouse\` where a package index is reachable and carry .wheelhouse/ with the checkout (torch itself must be this machine's)." | tee -a "$FIGURES"
  exit 1
fi
echo "every import rentplan needs is there" | tee -a "$FIGURES"

section "machine"
GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" 2>/dev/null)
{ date -u; if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4; else echo "nvidia-smi: not on this machine"; fi
  echo "${GPU:-no CUDA device: the GPU sections below say so and move on}"; } 2>&1 | tee -a "$FIGURES"

section "pytest -m gpu (CUDA tests)"
timeout 90 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -15 | tee -a "$FIGURES"

section "every path that builds the model in another process, on this torch (pytest -m cudabuild)"
if [ -n "$GPU" ]; then
  RENTPLAN_CUDA_BUILD=1 timeout 120 "$PY" -m pytest -m cudabuild -q -x -p no:cacheprovider tests/test_cuda_build.py \
    2>&1 | tail -15 | tee -a "$FIGURES"
else
  echo "no CUDA device: skipped here (CI runs this set under the CUDA build on every submission)" | tee -a "$FIGURES"
fi

section "estimate vs measured on this GPU (allocated, need vs reserved, update time) + allocator traces"
JSON=$(mktemp)
timeout 180 "$PY" benchmarks/gpu_vs_estimate.py --device cuda --out "$JSON" 2>&1 | grep -v Warning | tail -45 | tee -a "$FIGURES"

section "calibration of the time model's fractions (bandwidth, launch, matmul, attention)"
timeout 30 "$PY" benchmarks/gpu_calibration.py 2>&1 | tail -25 | tee -a "$FIGURES"

section "demo on cuda"
TMP=$(mktemp -d)
( cd "$TMP" && timeout 45 "$PY" -m planner demo --device cuda 2>&1 | tail -25 ) | tee -a "$FIGURES"
rm -rf "$TMP"

if [ -s "$JSON" ]; then section "estimate vs measured, every figure (JSON)"; cat "$JSON" >> "$FIGURES"; fi
rm -f "$JSON"
echo "figures written to $FIGURES"
