"""rentplan planner: plans GPU rentals from ledger lines and a catalog. Never imports torch.

The folders follow the pipeline: inputs/ (catalog, campaign spec, probe grids, safe YAML) → models/ (memory,
allocator, kernels, time) → decisions/ (evidence, selection, windows, budget) → outputs/ (tables, order sheet,
order.json, sky.yaml, reports). The line and its ledger (records.py, ledger.py) are shared with probes/;
tools/ holds the torch-free side tools (batch arithmetic, splits, archives)."""

from pathlib import Path

__version__ = "0.1.0"
PACKAGE_DIR = Path(__file__).resolve().parent  # the checkout's planner/, or the installed package
