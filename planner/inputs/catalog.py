"""catalog.yaml -> typed Gpu and Offer records (planner/catalog_records.py). The only code that knows its YAML.

Validation names every problem at once with its key path; memory is stored in bytes (GiB = 2**30).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from planner import PACKAGE_DIR
from planner.catalog_records import (  # noqa: F401  (re-exported)
    DISK_WRITE_MIB_S,
    Catalog,
    Gpu,
    Offer,
    normalize_gpu_name,
)
from planner.errors import CatalogError, InputError
from planner.inputs.schema import Defaults, GpuEntry, OfferEntry, validate
from planner.inputs.yamlsafe import MAX_CATALOG_BYTES, Problems, load_yaml_file, load_yaml_text
from planner.units import GiB

TOP_KEYS = {"schema", "defaults", "sources", "gpus", "offers"}
SCHEMA = "rentplan-catalog/1"


def default_catalog_path() -> Path:
    """The catalog.yaml of the checkout, else the copy shipped inside the installed package."""
    for candidate in (PACKAGE_DIR.parent / "catalog.yaml", PACKAGE_DIR / "catalog.yaml"):
        if candidate.is_file():
            return candidate
    raise CatalogError("no bundled catalog.yaml found; pass --catalog PATH.")


def load_catalog(path: str | Path | None = None) -> Catalog:
    path = Path(path) if path else default_catalog_path()
    data = load_yaml_file(path, "catalog", MAX_CATALOG_BYTES)
    return parse_catalog(data, str(path))


def parse_catalog(data, source: str) -> Catalog:
    """Validated by planner/inputs/schema.py (pydantic), each entry on its own so every problem is named with its
    key path; then the rules across entries: unique ids, offers of known GPUs, multi-node offers' network."""
    p = Problems(source)
    if not isinstance(data, dict):
        p.add("", "the catalog must be a mapping with gpus: and offers:")
        p.raise_if_any(CatalogError)
    p.unknown_keys("", data, TOP_KEYS)
    if data.get("schema", SCHEMA) != SCHEMA:
        p.add("schema", f"must be {SCHEMA!r} (this rentplan's catalog format), got {Problems.show(data['schema'])}")
    defaults = validate(Defaults, data.get("defaults") or {}, p, "defaults")
    sources = data.get("sources") or {}
    if not isinstance(sources, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
        p.add("sources", "must be a mapping of source tags to the text that names them")
        sources = {}
    gpus: dict[str, Gpu] = {}
    raw_gpus = data.get("gpus")
    if not isinstance(raw_gpus, list) or not raw_gpus:
        p.add("gpus", "must be a non-empty list")
        raw_gpus = []
    for i, g in enumerate(raw_gpus):
        entry = validate(GpuEntry, g, p, f"gpus[{i}]")
        if entry is None:
            continue
        if entry.bf16_supported and entry.bf16_dense_tflops is None:
            p.add(f"gpus[{i}].bf16_dense_tflops", "missing although bf16_supported is true")
            continue
        if entry.id in gpus:
            p.add(f"gpus[{i}].id", f"duplicate GPU id {entry.id!r}")
        gpus[entry.id] = _gpu(entry)
    offers: list[Offer] = []
    raw_offers = data.get("offers")
    if not isinstance(raw_offers, list) or not raw_offers:
        p.add("offers", "must be a non-empty list: a catalog without offers has nothing to rent")
        raw_offers = raw_offers if isinstance(raw_offers, list) else []
    seen: set[str] = set()
    known_gpu_ids = {g.get("id") for g in raw_gpus if isinstance(g, dict) and isinstance(g.get("id"), str)}
    for i, o in enumerate(raw_offers):
        offer = validate(OfferEntry, o, p, f"offers[{i}]")
        if offer is None or not _offer_rules(p, f"offers[{i}]", offer, known_gpu_ids):
            continue
        if offer.id in seen:
            p.add(f"offers[{i}].id", f"duplicate offer id {offer.id!r}")
        seen.add(offer.id)
        offers.append(Offer(**offer.model_dump()))
    p.raise_if_any(CatalogError)
    assert defaults is not None  # validate() said why it could not, and that was raised above
    return Catalog(gpus, offers, context_bytes=int(defaults.cuda_context_gib * GiB),
                   fragmentation_factor=float(defaults.fragmentation_factor), source=source, sources=dict(sources),
                   disk_write_mib_s=float(defaults.disk_write_mib_s))


def _gpu(e) -> Gpu:
    fields = e.model_dump()
    usable = fields.pop("memory_gib_usable")
    for key in ("tdp_w", "notes"):
        fields.pop(key)
    return Gpu(**fields, usable_bytes=int(float(usable) * GiB))


def _offer_rules(p: Problems, path: str, e, gpu_ids: set) -> bool:
    n0 = len(p.items)
    if e.nodes > 1:  # cross-node time needs the network's speed
        for key in ("network", "network_gbps"):
            if getattr(e, key) is None:
                p.add(f"{path}.{key}", f"required when nodes > 1 ({e.nodes} nodes): "
                                       + ("the interconnect's name" if key == "network" else
                                          "the node's network bandwidth in Gbit/s"))
    if e.gpu not in gpu_ids:
        hint = difflib.get_close_matches(e.gpu, [str(x) for x in gpu_ids], n=1)
        p.add(f"{path}.gpu", f"unknown GPU id {e.gpu!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    if e.note and e.note.startswith("region "):  # the region reaches sky.yaml's resources
        p.ident(f"{path}.note", e.note[len("region "):])
    return len(p.items) == n0


def merged_catalog_text(text: str, offers: list[dict], source: str) -> tuple[str, str]:
    """The catalog with the imported offers appended, and a note for the user. Appended as text where `offers:` is
    the last key (its comments are kept), else the whole document written out again (comments lost: the note says
    so)."""
    import yaml

    data = load_yaml_text(text, source, MAX_CATALOG_BYTES)
    before = len(data.get("offers") or [])
    appended = text.rstrip("\n") + "\n" + yaml.safe_dump(offers, sort_keys=False) if offers else text
    try:
        merged = load_yaml_text(appended, source, MAX_CATALOG_BYTES)
        if isinstance(merged, dict) and len(merged.get("offers") or []) == before + len(offers):
            return appended, ""
    except InputError:
        pass
    data["offers"] = list(data.get("offers") or []) + offers
    return yaml.safe_dump(data, sort_keys=False), (f"offers: is not the last key of {source}; the merged catalog "
                                                   "is written out whole (its comments are not kept)")
