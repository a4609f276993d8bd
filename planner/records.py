"""The ledger line: one record per (configuration, phase) of a pilot. Standard library only.

Bytes are int, seconds are float, units are in the field names. Allocated and reserved are separate
counters and are never added; a counter the device does not have is None, never invented.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from planner.optimizers import OPTIMIZERS  # noqa: F401  (re-exported: the names live in planner/optimizers.py)


class Verdict(str, enum.Enum):
    """How a phase ended. `skipped` = not reached because an earlier phase of the run failed."""

    OK = "ok"
    OOM = "oom"
    NONFINITE = "nonfinite"
    ERROR = "error"
    TIMEOUT = "timeout"
    KILLED = "killed"
    INTERRUPTED = "interrupted"
    SKIPPED = "skipped"


FAILED = {Verdict.OOM, Verdict.NONFINITE, Verdict.ERROR, Verdict.TIMEOUT, Verdict.KILLED}

PHASES = ("setup", "first_step", "steady", "eval", "save", "export", "resume")
# A run of the user's own loop (callbacks, --script) sizes a campaign once it has these: save, export and
# resume happen only where that loop does them.
OBSERVED_PHASES = ("setup", "first_step", "steady", "eval")
SOURCES = ("probe", "hf-trainer", "lightning", "script")
# fp32, bf16 and fp16 are Lightning's 32-true, bf16-mixed and 16-mixed (fp32 weights, autocast; fp16 with a
# gradient scaler). The *-true ones keep weights, gradients and optimizer state in that dtype (no autocast,
# no scaler), as a full fine-tune with torchtune's defaults does. Lightning's spellings are accepted as input.
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true", "16-true")
PRECISION_ALIASES = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "16": "fp16",
                     "fp16-true": "16-true"}
TRUE_PRECISIONS = {"bf16-true": "bf16", "16-true": "fp16"}  # the tensor dtype each one keeps everything in


def canonical_precision(name: str) -> str:
    """A precision as rentplan records it (Lightning's names are aliases)."""
    text = str(name).strip()
    return PRECISION_ALIASES.get(text, text)


@dataclass(frozen=True)
class ProbeConfig:
    """What one pilot run is asked to do. Every line carries these fields, so a ledger explains itself."""

    workload: str = "builtin:gpt"
    params_json: str = "{}"  # workload parameters, canonical JSON
    micro_batch: int = 1
    seq_len: int = 128
    eval_seq_len: int = 128
    eval_micro_batch: int = 1
    grad_accum: int = 1
    precision: str = "fp32"
    checkpointing: bool = False
    optimizer: str = "adamw"
    lr: float = 1e-4
    steady_updates: int = 3
    cap: str = ""  # catalog GPU id or size the allocator was capped at ("" = none)
    cap_bytes: int | None = None
    device: str = "cpu"
    mode: str = "measured"
    world_size: int = 1
    strategy: str = "single"
    target: str = ""  # estimates: the kernel class they emulate (e.g. "sm80+"); "" = the device's own kernels

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    def key(self) -> str:
        """Stable identity of a configuration: the same request always gets the same key."""
        fields = dataclasses.asdict(self)
        if not self.target:  # added later: absent when unset, so keys in older ledgers stay the same
            del fields["target"]
        blob = json.dumps(fields, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def label(self) -> str:
        ck = " ckpt" if self.checkpointing else ""
        cap = f" cap={self.cap}" if self.cap else ""
        dist = f" {self.strategy}×{self.world_size}" if self.world_size > 1 else ""
        return (f"mb={self.micro_batch} seq={self.seq_len} eval={self.eval_micro_batch}x{self.eval_seq_len} "
                f"acc={self.grad_accum} {self.precision} {self.optimizer}{ck}{cap}{dist}")


@dataclass(frozen=True)
class Line:
    """One phase of one run. Config fields first, then where it ran, then what was observed."""

    run_id: str
    probe_id: str
    config_key: str
    phase: str
    verdict: str
    # configuration (copied from ProbeConfig)
    workload: str
    params_json: str
    micro_batch: int
    seq_len: int
    eval_seq_len: int
    eval_micro_batch: int
    grad_accum: int
    effective_batch: int
    precision: str
    checkpointing: bool
    optimizer: str
    lr: float
    cap: str
    cap_bytes: int | None
    mode: str
    strategy: str
    target: str
    rank: int
    world_size: int
    # where it ran
    device: str
    device_name: str
    device_total_bytes: int | None
    torch_version: str
    cuda_version: str | None
    host: str
    started_at: str
    # what was observed
    baseline_allocated_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    # CPU lines and estimates: the reserved peak a CUDA GPU's caching allocator would show for this phase's
    # allocations, from a model of it (planner/models/allocator.py). Never a device counter: measured reserved is above.
    simulated_reserved_bytes: int | None = None
    device_used_bytes: int | None = None  # CUDA: driver-level use (mem_get_info); CPU: peak RSS
    context_bytes: int | None = None  # CUDA context and other memory outside the allocator
    num_ooms_delta: int | None = None
    seconds: float | None = None
    update_times_s: str = "[]"  # JSON list of synchronized per-update times (steady)
    update_s: float | None = None  # median of update_times_s
    flops_per_update: float | None = None  # steady: one update's FLOPs, from the census pass (probes/census.py)
    ops_per_update: int | None = None  # steady: kernel launches per update, same census
    op_profile_json: str = ""  # steady: per kernel target, the update's ops as [kind, dtype, flops, bytes, count]
    param_count: int | None = None
    trainable_param_count: int | None = None
    param_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    checkpoint_bytes: int | None = None
    loss_first: float | None = None
    loss_last: float | None = None
    nonfinite_update: int | None = None
    detail: str = ""
    # Who wrote the line: "probe" (rentplan ran the loop, every phase in order) or the user's own loop seen by a
    # callback ("hf-trainer", "lightning") or by `probe --script` ("script"). Empty in older ledgers = probe.
    source: str = "probe"
    # The model-code libraries the process had imported when the line was written, with their versions
    # ("transformers 4.46.3, peft 0.13.2"): the code whose layers were measured or traced; "" = none (builtin).
    libraries: str = ""
    # setup: the longest sequence the model takes and where that was read (probes/positions.py); None = not stated
    position_limit: int | None = None
    position_limit_basis: str = ""
    # The model call's batch as read by role (planner/shapes.py): "tokens 8×512", "image 8×3×32×32"; eval lines hold
    # eval's. Written by the user's own loop (--script, callbacks); empty where nothing was read (older ledgers,
    # rentplan's own probes, which are told their shape).
    input_shape: str = ""

    @classmethod
    def from_config(cls, cfg: ProbeConfig, **kw) -> "Line":
        base: dict[str, Any] = {
            "workload": cfg.workload, "params_json": cfg.params_json, "micro_batch": cfg.micro_batch,
            "seq_len": cfg.seq_len, "eval_seq_len": cfg.eval_seq_len, "eval_micro_batch": cfg.eval_micro_batch,
            "grad_accum": cfg.grad_accum, "effective_batch": cfg.effective_batch, "precision": cfg.precision,
            "checkpointing": cfg.checkpointing, "optimizer": cfg.optimizer, "lr": cfg.lr, "cap": cfg.cap,
            "cap_bytes": cfg.cap_bytes, "mode": cfg.mode, "strategy": cfg.strategy,
            "world_size": cfg.world_size, "target": cfg.target, "config_key": cfg.key(),
        }
        base.update(kw)
        base.setdefault("rank", 0)
        return cls(**base)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Pinned explicitly (not derived at import from the dataclass elsewhere) so the ledger format is a contract.
LINE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Line))
