"""SkyPilot's catalog: a vms.csv (sky/catalog/data_fetchers write one per cloud), parsed by header, since the column
order differs between clouds. Prices are per instance; GPU memory comes from rentplan's catalog, and GpuInfo is read
only to cross-check the name mapping.

Example: rentplan catalog import --from skypilot vms.csv --provider lambda --as-of 2026-12-01
"""

from __future__ import annotations

import ast
import csv
from pathlib import Path

from planner.catalog_records import Catalog, Gpu, normalize_gpu_name
from planner.errors import CatalogError
from planner.units import GiB

NAME = "skypilot"
FILE = "a SkyPilot catalog vms.csv"


def read(path: str | Path, catalog: Catalog, provider: str, as_of: str) -> tuple[list[dict], list[str]]:
    """Rows of a SkyPilot vms.csv -> offer dicts for GPUs the catalog knows; plus what was skipped and why."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return _import_rows(csv.DictReader(f), path, catalog, provider, as_of)
    except UnicodeDecodeError as e:
        raise CatalogError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); SkyPilot writes UTF-8: "
                           "re-export it, or convert it with iconv.") from None
    except csv.Error as e:
        raise CatalogError(f"{path} is not a readable CSV ({e}).") from None


def _import_rows(reader, csv_path, catalog: Catalog, provider: str, as_of: str) -> tuple[list[dict], list[str]]:
    offers: list[dict] = []
    skipped: list[str] = []
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
