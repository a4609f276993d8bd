"""rentplan planner: plans GPU rentals from ledger lines and a catalog. Never imports torch.

The folders follow the pipeline: inputs/ (catalog, campaign spec, probe grids, safe YAML) → models/ (memory,
allocator, kernels, time) → decisions/ (evidence, selection, windows, budget) → outputs/ (tables, order sheet,
order.json, sky.yaml, reports). The records (records.py: the line; catalog_records.py: GPUs, offers, the catalog)
and the ledger are shared with probes/; tools/ holds the torch-free side tools (splits, archives). Imports point down
only: the ground (records, units, errors, ...) < models < inputs < decisions < outputs < tools < commands
(tests/test_layout.py)."""

from pathlib import Path

__version__ = "0.1.0"
PACKAGE_DIR = Path(__file__).resolve().parent  # the checkout's planner/, or the installed package
