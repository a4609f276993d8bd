"""rentplan planner: plans GPU rentals from ledger lines and a catalog. Never imports torch."""

__version__ = "0.1.0"
