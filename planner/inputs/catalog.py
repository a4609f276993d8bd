"""catalog.yaml -> typed Gpu and Offer records. The only code that knows the catalog's YAML.

Validation names every problem at once with its key path; memory is stored in bytes (GiB = 2**30).
"""

from __future__ import annotations

import ast
import csv
import difflib
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from planner import PACKAGE_DIR
from planner.errors import CatalogError, InputError
from planner.units import GiB
from planner.inputs.yamlsafe import MAX_CATALOG_BYTES, Problems, load_yaml_file

GPU_KEYS = {"id", "name", "vendor", "arch", "compute_capability", "memory_gb_marketed", "memory_gib_usable",
            "mem_bandwidth_tbps", "bf16_dense_tflops", "fp16_dense_tflops", "tf32_dense_tflops", "fp32_tflops",
            "fp8_dense_tflops", "bf16_supported", "fp8_supported", "interconnect", "nvlink_gbps", "tdp_w",
            "mamf_bf16_tflops", "min_cuda", "software", "notes", "sources", "unverified"}
GPU_REQUIRED = ["id", "name", "vendor", "memory_gb_marketed", "memory_gib_usable", "mem_bandwidth_tbps",
                "bf16_supported", "fp8_supported"]
OFFER_KEYS = {"id", "gpu", "provider", "instance", "gpus_per_instance", "price_per_instance_hour_usd", "spot",
              "billing_minimum_hours", "as_of", "source", "note", "unverified", "network", "nodes", "network_gbps",
              "disk_write_mib_s"}
OFFER_REQUIRED = ["id", "gpu", "provider", "gpus_per_instance", "price_per_instance_hour_usd", "spot", "as_of",
                  "source"]
TOP_KEYS = {"schema", "defaults", "sources", "gpus", "offers"}
DEFAULT_KEYS = {"cuda_context_gib", "fragmentation_factor", "disk_write_mib_s"}
# Checkpoints and exports are written at this rate where an offer states none and no GPU line of that kind timed
# them: an assumption (a cloud block volume's sustained write, the low end of what providers list), said as one.
DISK_WRITE_MIB_S = 200.0


@dataclass(frozen=True)
class Gpu:
    id: str
    name: str
    vendor: str
    memory_gb_marketed: float
    usable_bytes: int
    mem_bandwidth_tbps: float
    bf16_supported: bool
    fp8_supported: bool
    compute_capability: str | None = None
    arch: str | None = None
    bf16_dense_tflops: float | None = None
    fp16_dense_tflops: float | None = None
    tf32_dense_tflops: float | None = None
    fp32_tflops: float | None = None
    fp8_dense_tflops: float | None = None
    interconnect: str | None = None
    nvlink_gbps: float | None = None
    mamf_bf16_tflops: float | None = None
    min_cuda: str | None = None
    software: str = "cuda"
    sources: tuple[str, ...] = ()
    unverified: tuple[str, ...] = ()

    def peak_tflops(self, precision: str) -> float | None:
        precision = {"bf16-true": "bf16", "16-true": "fp16"}.get(precision, precision)
        if precision == "bf16":
            return self.bf16_dense_tflops
        if precision == "fp16":
            return self.fp16_dense_tflops
        # PyTorch's fp32 matmuls do not use TF32 unless the workload enables it (allow_tf32 is False since 1.12)
        return self.fp32_tflops

    def sm(self) -> float | None:
        try:
            return float(self.compute_capability) if self.compute_capability else None
        except ValueError:
            return None


@dataclass(frozen=True)
class Offer:
    id: str
    gpu: str
    provider: str
    gpus_per_instance: int
    price_per_instance_hour_usd: float
    spot: bool
    as_of: str
    source: str
    billing_minimum_hours: float = 0.0
    instance: str | None = None
    note: str | None = None
    nodes: int = 1  # multi-node offers: `nodes` instances rented together, joined by `network`
    network: str | None = None
    network_gbps: float | None = None  # per node, Gbit/s (e.g. 3200 for 8 × 400 Gb/s InfiniBand)
    unverified: tuple[str, ...] = ()
    disk_write_mib_s: float | None = None  # the offer's disk, MiB/s (None: the catalog default, assumed)

    @property
    def region(self) -> str | None:
        """The region an imported offer names (catalog import keeps it in the note as "region X")."""
        note = self.note or ""
        return note[len("region "):] if note.startswith("region ") else None

    @property
    def price_per_gpu_hour_usd(self) -> float:
        return self.price_per_instance_hour_usd / self.gpus_per_instance

    @property
    def price_per_hour_usd(self) -> float:
        """What the whole offer costs per hour: every node of it."""
        return self.price_per_instance_hour_usd * self.nodes


@dataclass
class Catalog:
    gpus: dict[str, Gpu]
    offers: list[Offer]
    context_bytes: int = GiB // 2
    fragmentation_factor: float = 1.15
    disk_write_mib_s: float = DISK_WRITE_MIB_S
    source: str = ""
    sources: dict[str, str] = field(default_factory=dict)

    def gpu(self, gpu_id: str) -> Gpu:
        if gpu_id in self.gpus:
            return self.gpus[gpu_id]
        norm = normalize_gpu_name(gpu_id)
        if norm in self.gpus:
            return self.gpus[norm]
        hint = difflib.get_close_matches(norm, list(self.gpus), n=3, cutoff=0.5)
        more = f" Did you mean {' or '.join(repr(h) for h in hint)}?" if hint else ""
        raise CatalogError(f"unknown GPU {gpu_id!r}.{more} `rentplan catalog list` shows the ids.")

    def offers_frame(self) -> pd.DataFrame:
        rows = []
        for o in self.offers:
            row = asdict(o)
            row["price_per_gpu_hour_usd"] = o.price_per_gpu_hour_usd
            rows.append(row)
        return pd.DataFrame(rows)


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
    p = Problems(source)
    if not isinstance(data, dict):
        p.add("", "the catalog must be a mapping with gpus: and offers:")
        p.raise_if_any(CatalogError)
    p.unknown_keys("", data, TOP_KEYS)
    defaults = p.mapping("defaults", data.get("defaults") or {}, DEFAULT_KEYS) or {}
    ctx = p.number("defaults.cuda_context_gib", defaults.get("cuda_context_gib", 0.5), positive=True, allow_zero=True)
    frag = p.number("defaults.fragmentation_factor", defaults.get("fragmentation_factor", 1.15), positive=True)
    disk = p.number("defaults.disk_write_mib_s", defaults.get("disk_write_mib_s", DISK_WRITE_MIB_S), positive=True,
                    minimum=1, maximum=1e6)
    if frag is not None and frag < 1:
        p.add("defaults.fragmentation_factor", f"must be >= 1 (reserved is never below allocated), got {frag}")
    gpus: dict[str, Gpu] = {}
    raw_gpus = data.get("gpus")
    if not isinstance(raw_gpus, list) or not raw_gpus:
        p.add("gpus", "must be a non-empty list")
        raw_gpus = []
    for i, g in enumerate(raw_gpus):
        gpu = _parse_gpu(p, f"gpus[{i}]", g)
        if gpu is not None:
            if gpu.id in gpus:
                p.add(f"gpus[{i}].id", f"duplicate GPU id {gpu.id!r}")
            gpus[gpu.id] = gpu
    offers: list[Offer] = []
    raw_offers = data.get("offers")
    if raw_offers is None:
        raw_offers = []
    if not isinstance(raw_offers, list) or not raw_offers:
        p.add("offers", "must be a non-empty list: a catalog without offers has nothing to rent")
        raw_offers = raw_offers if isinstance(raw_offers, list) else []
    seen: set[str] = set()
    known_gpu_ids = {g.get("id") for g in raw_gpus if isinstance(g, dict)}
    for i, o in enumerate(raw_offers):
        offer = _parse_offer(p, f"offers[{i}]", o, known_gpu_ids)
        if offer is not None:
            if offer.id in seen:
                p.add(f"offers[{i}].id", f"duplicate offer id {offer.id!r}")
            seen.add(offer.id)
            offers.append(offer)
    p.raise_if_any(CatalogError)
    return Catalog(gpus, offers, context_bytes=int(ctx * GiB), fragmentation_factor=float(frag), source=source,
                   sources=dict(data.get("sources") or {}), disk_write_mib_s=float(disk))


# (minimum, maximum) of each GPU figure: a value outside is a typo or an attack, and would break the planner.
GPU_BOUNDS = {"memory_gb_marketed": (0.25, 4096), "memory_gib_usable": (0.25, 4096), "mem_bandwidth_tbps": (0.01, 100),
              "bf16_dense_tflops": (0.1, 1e5), "fp16_dense_tflops": (0.1, 1e5), "tf32_dense_tflops": (0.1, 1e5),
              "fp32_tflops": (0.1, 1e5), "fp8_dense_tflops": (0.1, 1e5), "nvlink_gbps": (1, 1e5),
              "mamf_bf16_tflops": (0.1, 1e5), "tdp_w": (1, 1e5)}


def _parse_gpu(p: Problems, path: str, g) -> Gpu | None:
    n0 = len(p.items)
    if p.mapping(path, g, GPU_KEYS) is None:
        return None
    p.require(path, g, GPU_REQUIRED)
    for key, (lo, hi) in GPU_BOUNDS.items():
        if g.get(key) is not None:
            p.number(f"{path}.{key}", g[key], positive=True, minimum=lo, maximum=hi)
    for key in ("bf16_supported", "fp8_supported"):
        if g.get(key) is not None:
            p.boolean(f"{path}.{key}", g[key])
    if g.get("id") is not None:
        p.ident(f"{path}.id", g["id"])
    if g.get("name") is not None:
        p.label(f"{path}.name", g["name"])
    if g.get("bf16_supported") is True and g.get("bf16_dense_tflops") is None:
        p.add(f"{path}.bf16_dense_tflops", "missing although bf16_supported is true")
    if len(p.items) > n0:
        return None
    return Gpu(
        id=g["id"], name=g["name"], vendor=g["vendor"], memory_gb_marketed=float(g["memory_gb_marketed"]),
        usable_bytes=int(float(g["memory_gib_usable"]) * GiB), mem_bandwidth_tbps=float(g["mem_bandwidth_tbps"]),
        bf16_supported=g["bf16_supported"], fp8_supported=g["fp8_supported"],
        compute_capability=_opt_str(g.get("compute_capability")), arch=g.get("arch"),
        bf16_dense_tflops=_num(g.get("bf16_dense_tflops")), fp16_dense_tflops=_num(g.get("fp16_dense_tflops")),
        tf32_dense_tflops=_num(g.get("tf32_dense_tflops")), fp32_tflops=_num(g.get("fp32_tflops")),
        fp8_dense_tflops=_num(g.get("fp8_dense_tflops")), interconnect=g.get("interconnect"),
        nvlink_gbps=_num(g.get("nvlink_gbps")), mamf_bf16_tflops=_num(g.get("mamf_bf16_tflops")),
        min_cuda=_opt_str(g.get("min_cuda")), software=g.get("software") or "cuda",
        sources=tuple(g.get("sources") or ()), unverified=tuple(str(u) for u in g.get("unverified") or ()))


def _parse_offer(p: Problems, path: str, o, gpu_ids: set) -> Offer | None:
    n0 = len(p.items)
    if p.mapping(path, o, OFFER_KEYS) is None:
        return None
    p.require(path, o, OFFER_REQUIRED)
    if o.get("price_per_instance_hour_usd") is not None:
        p.number(f"{path}.price_per_instance_hour_usd", o["price_per_instance_hour_usd"], positive=True,
                 maximum=10_000)
    if o.get("gpus_per_instance") is not None:
        p.number(f"{path}.gpus_per_instance", o["gpus_per_instance"], positive=True, integer=True, maximum=64)
    if o.get("billing_minimum_hours") is not None:
        p.number(f"{path}.billing_minimum_hours", o["billing_minimum_hours"], positive=True, allow_zero=True,
                 maximum=8760)
    if o.get("spot") is not None:
        p.boolean(f"{path}.spot", o["spot"])
    nodes = 1
    if o.get("nodes") is not None:
        nodes = p.number(f"{path}.nodes", o["nodes"], positive=True, integer=True, maximum=4096) or 1
    if o.get("network_gbps") is not None:
        p.number(f"{path}.network_gbps", o["network_gbps"], positive=True, maximum=100_000)
    if o.get("disk_write_mib_s") is not None:
        p.number(f"{path}.disk_write_mib_s", o["disk_write_mib_s"], positive=True, minimum=1, maximum=1e6)
    for key in ("id", "provider"):  # both reach sky.yaml and shell lines: ids, look-alikes refused by name
        if o.get(key) is not None:
            p.ident(f"{path}.{key}", o[key])
    for key in ("as_of", "source", "instance"):
        if o.get(key) is not None:
            p.label(f"{path}.{key}", str(o[key]) if isinstance(o[key], (int, float)) else o[key])
    note = o.get("note")
    if isinstance(note, str) and note.startswith("region "):  # the region reaches sky.yaml's resources
        p.ident(f"{path}.note", note[len("region "):])
    if nodes > 1:  # cross-node time needs the network's speed
        for key in ("network", "network_gbps"):
            if o.get(key) is None:
                p.add(f"{path}.{key}", f"required when nodes > 1 ({int(nodes)} nodes): "
                                       + ("the interconnect's name" if key == "network" else
                                          "the node's network bandwidth in Gbit/s"))
    gpu = o.get("gpu")
    if gpu is not None and gpu not in gpu_ids:
        hint = difflib.get_close_matches(str(gpu), [str(x) for x in gpu_ids], n=1)
        p.add(f"{path}.gpu", f"unknown GPU id {gpu!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    if len(p.items) > n0:
        return None
    return Offer(id=str(o["id"]), gpu=gpu, provider=str(o["provider"]), gpus_per_instance=int(o["gpus_per_instance"]),
                 price_per_instance_hour_usd=float(o["price_per_instance_hour_usd"]), spot=o["spot"],
                 as_of=str(o["as_of"]), source=str(o["source"]),
                 billing_minimum_hours=float(o.get("billing_minimum_hours") or 0.0), instance=o.get("instance"),
                 note=o.get("note"), nodes=int(nodes), network=o.get("network"),
                 network_gbps=None if o.get("network_gbps") is None else float(o["network_gbps"]),
                 unverified=tuple(str(u) for u in o.get("unverified") or ()),
                 disk_write_mib_s=None if o.get("disk_write_mib_s") is None else float(o["disk_write_mib_s"]))


def _num(x) -> float | None:
    """A validated number (YAML may hand over '121' or 1e3 as text)."""
    return None if x is None else float(x)


def _opt_str(x) -> str | None:
    return None if x is None else str(x)


# --- SkyPilot catalog import (vms.csv, parsed by header: column order differs between clouds) ---

_NAME_MAP = {
    "a100": "a100_40gb", "a100-40gb": "a100_40gb", "a100-80gb": "a100_80gb_pcie", "a100-80gb-sxm": "a100_80gb_sxm",
    "a100-80gb-sxm4": "a100_80gb_sxm", "h100": "h100_sxm", "h100-sxm": "h100_sxm", "h100-sxm5": "h100_sxm",
    "h100-pcie": "h100_pcie", "h100-nvl": "h100_nvl", "h100nvl": "h100_nvl", "h200": "h200_sxm", "b200": "b200",
    "gh200": "gh200", "l4": "l4", "l40": "l40", "l40s": "l40s", "a10": "a10", "a10g": "a10g", "a6000": "rtx_a6000",
    "rtxa6000": "rtx_a6000", "rtx-a6000": "rtx_a6000", "rtx6000-ada": "rtx_6000_ada", "rtx6000ada": "rtx_6000_ada",
    "rtx4090": "rtx_4090", "rtx-4090": "rtx_4090", "rtx3090": "rtx_3090", "rtx-3090": "rtx_3090", "v100": "v100_16gb",
    "v100-32gb": "v100_32gb", "t4": "t4", "mi300x": "mi300x", "mi250": "mi250",
}


def normalize_gpu_name(name: str) -> str:
    """'H100-SXM', 'A100-80GB', 'RTX 4090' ... -> the catalog's GPU id (or the lowercased name)."""
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    return _NAME_MAP.get(key, _NAME_MAP.get(key.replace("-", ""), key.replace("-", "_")))


def import_skypilot(csv_path: str | Path, catalog: Catalog, provider: str, as_of: str) -> tuple[list[dict], list[str]]:
    """Rows of a SkyPilot vms.csv -> offer dicts for GPUs the catalog knows; plus what was skipped and why."""
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            return _import_rows(csv.DictReader(f), csv_path, catalog, provider, as_of)
    except UnicodeDecodeError as e:
        raise CatalogError(f"{csv_path} is not UTF-8 text ({e.reason} at byte {e.start}); SkyPilot writes UTF-8: "
                           "re-export it, or convert it with iconv.") from None
    except csv.Error as e:
        raise CatalogError(f"{csv_path} is not a readable CSV ({e}).") from None


def _import_rows(reader, csv_path, catalog: Catalog, provider: str, as_of: str) -> tuple[list[dict], list[str]]:
    offers, skipped = [], []
    need = {"AcceleratorName", "AcceleratorCount", "Price"}
    missing = need - set(reader.fieldnames or [])
    if missing:
        raise CatalogError(f"{csv_path} is not a SkyPilot vms.csv: missing columns {', '.join(sorted(missing))}.")
    for i, row in enumerate(reader, start=2):
        name = (row.get("AcceleratorName") or "").strip()
        if not name:
            continue  # CPU-only rows and GCP VM-part rows
        gpu_id = normalize_gpu_name(name)
        if gpu_id not in catalog.gpus:
            skipped.append(f"line {i}: GPU {name!r} is not in the catalog")
            continue
        try:
            count = int(float(row["AcceleratorCount"]))
            price = float(row["Price"])
        except (TypeError, ValueError):
            skipped.append(f"line {i}: unreadable count or price")
            continue
        if count <= 0 or not price > 0 or price >= 700.0:  # 700.0 is GCP's "unavailable" sentinel
            skipped.append(f"line {i}: no usable price ({row.get('Price')!r})")
            continue
        spot_txt = (row.get("SpotPrice") or "").strip()
        try:
            spot = float(spot_txt) if spot_txt else 0.0
        except ValueError:
            skipped.append(f"line {i}: SpotPrice {spot_txt[:40]!r} is not a number (kept the on-demand offer)")
            spot = 0.0
        _check_gpuinfo(row.get("GpuInfo") or row.get("GPUInfo"), count, catalog.gpus[gpu_id], skipped, i)
        region = (row.get("Region") or "").strip()
        base = {"gpu": gpu_id, "provider": provider, "instance": (row.get("InstanceType") or "").strip() or None,
                "gpus_per_instance": count, "billing_minimum_hours": 0.0, "as_of": as_of,
                "source": f"skypilot:{Path(csv_path).name}", "note": f"region {region}" if region else None}
        offers.append({"id": f"{provider}-{gpu_id}-{count}x-{len(offers) + 1}",
                       "price_per_instance_hour_usd": round(price, 4), "spot": False, **base,
                       "unverified": ["billing_minimum_hours"]})
        if spot > 0 and abs(spot - price) > 1e-9:  # empty, 0.00 and == Price all mean "no spot price"
            offers.append({"id": f"{provider}-{gpu_id}-{count}x-spot-{len(offers) + 1}",
                           "price_per_instance_hour_usd": round(spot, 4), "spot": True, **base,
                           "unverified": ["billing_minimum_hours"]})
    return offers, skipped


def _check_gpuinfo(text: str | None, count: int, gpu: Gpu, skipped: list[str], line: int) -> None:
    """GpuInfo is a Python literal (single quotes), read with ast.literal_eval; used only as a cross-check."""
    if not text or "{" not in text:
        return
    try:
        info = ast.literal_eval(text)
        mib = float(info["Gpus"][0]["MemoryInfo"]["SizeInMiB"])
    except (ValueError, SyntaxError, KeyError, IndexError, TypeError):
        skipped.append(f"line {line}: GpuInfo unreadable (kept the offer; memory comes from the catalog)")
        return
    per_gpu_gib = {mib / 1024, mib / 1024 / count, mib * 1e9 / GiB / 1024}  # per GPU, total, or GB (RunPod)
    marketed_gib = gpu.memory_gb_marketed * 1e9 / GiB
    if not any(abs(x - marketed_gib) / marketed_gib < 0.15 or abs(x * 1024 - gpu.memory_gb_marketed) < 1
               for x in per_gpu_gib):
        skipped.append(f"line {line}: GpuInfo says {mib:.0f} MiB, far from {gpu.id}'s {gpu.memory_gb_marketed} GB "
                       "(kept the offer; check the name mapping)")


def merged_catalog_text(text: str, offers: list[dict], source: str) -> tuple[str, str]:
    """The catalog with the imported offers appended, and a note for the user. Appended as text where `offers:` is
    the last key (its comments are kept), else the whole document written out again (comments lost: the note says so)."""
    import yaml

    from planner.inputs.yamlsafe import MAX_CATALOG_BYTES, load_yaml_text

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
