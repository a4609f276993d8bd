# Two entry points for a fresh machine:  make demo  and  make test.
# TORCH pins the CPU build on machines without a GPU (no multi-GB CUDA download); on a GPU machine use
#   make demo TORCH="torch"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test lint test-slow test-all test-cuda-build browser sky bench bench-truth bench-conv gpu-check wheelhouse clean

$(BIN)/rentplan: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[probe,report,hf,quant,callbacks,test,lint]"
	touch $@

install: $(BIN)/rentplan

demo: install
	$(BIN)/rentplan demo
	@echo "The CLI is $(BIN)/rentplan (or: source $(BIN)/activate, then rentplan --help)."

# The everyday suite (under 3 minutes on 2 cores); the slow tests (real pilots, torchrun, 8B estimates) run in
# CI after it (.ci/run), or here with make test-slow / make test-all.
test: install
	$(BIN)/python -m pytest -q -m "not slow and not cudabuild"

# ruff (lint, import order) over the project and mypy over the torch-free planner (pyproject.toml's settings)
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test-slow: install
	$(BIN)/python -m pytest -q -m "slow or cudabuild"

# The torch a GPU user gets from a plain `pip install torch` (PyTorch's default Linux wheel, a CUDA build; it runs
# on this CPU too), for the tests of every path that builds the user's model in another process (marked cudabuild):
# the CPU build hides CUDA's fork rule. The GPU machine's release: make test-cuda-build TORCH_CUDA=torch==2.11.0
# CUDA_VENV=.venv-cuda-2.11
CUDA_VENV ?= .venv-cuda
TORCH_CUDA ?= torch
test-cuda-build: $(CUDA_VENV)/installed
	RENTPLAN_CUDA_BUILD=1 $(CUDA_VENV)/bin/python -m pytest -q -m cudabuild
$(CUDA_VENV)/installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install -q --upgrade pip
	$(CUDA_VENV)/bin/pip install -q "$(TORCH_CUDA)"
	$(CUDA_VENV)/bin/pip install -q -e ".[probe,report,hf,quant,callbacks,test]"
	$(CUDA_VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.backends.cuda.is_built() else 'not a CUDA build: ' + torch.__version__)"
	touch $@

test-all: install
	$(BIN)/python -m pytest -q

# SkyPilot's parser, for the sky.yaml test. Its own environment: skypilot pins click < 8.2, which the hub under
# transformers refuses. Without it that test skips and names this target; .ci/run runs it.
sky: .venv-sky/installed
.venv-sky/installed:
	$(PYTHON) -m venv .venv-sky
	.venv-sky/bin/pip install -q "skypilot>=0.10"
	touch $@

# Chromium for the order-sheet page test (Debian's package; needs root). Without it that test skips.
browser:
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

bench: install
	$(BIN)/python benchmarks/probe_overhead.py

# The sizing benchmark against the public H100 runs (benchmarks/gpu-truth/h100.csv), in an environment of its own:
# timm needs torchvision, and the package index has no CPU torchvision for the pinned torch 2.13.0+cpu; torch 2.14.1
# and torchvision 0.29.1 lie on this machine's disk (they run on the CPU here). transformers is the release line the
# rows ran (measured 2024-10-29): the models' code is what is sized, and today's T5 is not 2024's. Not part of CI.
BENCH ?= .venv-bench
bench-truth: $(BENCH)/installed
	$(BENCH)/bin/python benchmarks/gpu_truth.py
bench-conv: $(BENCH)/installed
	$(BENCH)/bin/python benchmarks/conv_truth.py --fit
$(BENCH)/installed: pyproject.toml Makefile  # the pins below are in this file
	$(PYTHON) -m venv $(BENCH)
	$(BENCH)/bin/pip install -q --upgrade pip
	$(BENCH)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 timm "transformers==4.46.3"
	$(BENCH)/bin/pip install -q -e ".[probe,hf]"
	touch $@

# On the GPU machine as it is (its python3 and torch; nothing installed): bash benchmarks/gpu_check.sh. Its Python
# lacks pydantic: `make wheelhouse` here puts rentplan's pure-Python dependencies, built for that Python (3.12,
# manylinux x86_64), in .wheelhouse/ (git-ignored, about 3 MB), which travels with the checkout.
gpu-check:
	bash benchmarks/gpu_check.sh
GPU_PYTHON_VERSION ?= 3.12
wheelhouse: .wheelhouse/ready
.wheelhouse/ready: pyproject.toml Makefile
	rm -rf .wheelhouse && mkdir -p .wheelhouse
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .wheelhouse "pydantic>=2.5" "pathspec>=0.12"
	touch $@

clean:
	rm -rf $(VENV) .venv-sky $(CUDA_VENV) $(BENCH) rentplan-out rentplan.db rentplan.db-* *.egg-info build
