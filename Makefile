# Two entry points for a fresh machine:  make demo  and  make test.
# TORCH pins the CPU build on machines without a GPU (no multi-GB CUDA download); on a GPU machine use
#   make demo TORCH="torch"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install demo test test-slow test-all browser sky bench bench-truth gpu-check clean

$(BIN)/rentplan: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[probe,report,hf,quant,callbacks,test]"
	touch $@

install: $(BIN)/rentplan

demo: install
	$(BIN)/rentplan demo
	@echo "The CLI is $(BIN)/rentplan (or: source $(BIN)/activate, then rentplan --help)."

# The everyday suite (under 3 minutes on 2 cores); the slow tests (real pilots, torchrun, 8B estimates) run in
# CI after it (.ci/run), or here with make test-slow / make test-all.
test: install
	$(BIN)/python -m pytest -q -m "not slow"

test-slow: install
	$(BIN)/python -m pytest -q -m slow

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

# The sizing benchmark against the public H100 runs (../shared/gpu-truth/h100.csv), in an environment of its own:
# timm needs torchvision, and the package index has no CPU torchvision for the pinned torch 2.13.0+cpu; torch 2.14.1
# and torchvision 0.29.1 lie on this machine's disk (they run on the CPU here). transformers is the release line the
# rows ran (measured 2024-10-29): the models' code is what is sized, and today's T5 is not 2024's. Not part of CI.
BENCH ?= .venv-bench
bench-truth: $(BENCH)/installed
	$(BENCH)/bin/python benchmarks/gpu_truth.py
$(BENCH)/installed: pyproject.toml Makefile  # the pins below are in this file
	$(PYTHON) -m venv $(BENCH)
	$(BENCH)/bin/pip install -q --upgrade pip
	$(BENCH)/bin/pip install -q torch==2.14.1 torchvision==0.29.1 timm "transformers==4.46.3"
	$(BENCH)/bin/pip install -q -e ".[probe,hf]"
	touch $@

gpu-check: install
	bash benchmarks/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-sky $(BENCH) rentplan-out rentplan.db rentplan.db-* *.egg-info build
