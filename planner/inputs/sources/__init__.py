"""Catalog sources: one module per source that `rentplan catalog import --from NAME FILE` reads offers from.

Each module has NAME, FILE (what the file is, for help) and one function,
`read(path, catalog, provider, as_of) -> (offers, skipped)`: offer dicts for the GPUs the catalog knows (the
offers: entries of catalog.yaml) and, for every row left out, why. A new source is a module of that shape and a
line below."""

from __future__ import annotations

from planner.inputs.sources import skypilot

SOURCES = {m.NAME: m for m in (skypilot,)}
