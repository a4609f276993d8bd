"""The catalog's records: a GPU, an offer to rent one, and the catalog that holds them. No YAML, no torch.

inputs/catalog.py reads catalog.yaml into these; models/, decisions/ and outputs/ see only them. Memory is in bytes
(GiB = 2**30), prices in USD per hour.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from planner.errors import CatalogError
from planner.units import GiB

if TYPE_CHECKING:
    import pandas as pd

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
    sm_count: int | None = None  # streaming multiprocessors: a GEMM's tiles run in waves of one per SM
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
        import pandas as pd  # a heavy library, loaded by the one method that needs it

        rows = []
        for o in self.offers:
            row = asdict(o)
            row["price_per_gpu_hour_usd"] = o.price_per_gpu_hour_usd
            rows.append(row)
        return pd.DataFrame(rows)



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
