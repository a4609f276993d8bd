"""Ledger lines from a loop rentplan does not run: the user's own Trainer, Lightning module or script.

A PhaseRecorder is told where phases begin and end (by a callback or by hooks, see probes/callbacks.py and
probes/script.py) and measures between those marks with the probe's own meter (probes/memory.py): on CUDA the
allocator's peaks (allocated and reserved, apart), on a CPU the exact live-tensor tracker and the simulated
CUDA caching allocator. Lines are written as each phase ends, so a crash loses only the phase it was in, and
that phase is written as its verdict (oom, error) before the exception goes on.

Which phase is which:
- setup: from the recorder's start to the loop's first update (the model already exists: its tensors are
  counted from the start, and setup's seconds are not measured).
- first_step: the first optimizer update, which creates the optimizer state.
- steady: the next `steady_updates` updates (their peaks together, each update's time). One update is set
  apart for the op census (probes/census.py counts its FLOPs, bytes and launches for the time model); neither
  its time nor its memory is in the steady line, since an instrument must not ride beside what it measures.
- eval, save, export: the first of each (later ones repeat them). They nest as a loop nests them: a save that
  starts while eval is open (evaluate, checkpoint, then `model.train()` at the next step) pauses eval, is
  measured as its own phase, and eval resumes after it; eval's line joins its segments (peaks: the larger,
  seconds: the sum), so neither phase is lost nor holds the other's time.

A run's configuration (micro-batch, sequence length, accumulation, precision, ...) is fixed when its first
update ends: micro-batch and sequence length are those the model was called with, read by role
(planner/shapes.py: an image's sequence length is its positions, H×W), and every line keeps what was read
(`input_shape`, eval's own on the eval line). An eval line that ran a longer sequence than configured carries
the shape it ran, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from datetime import datetime, timezone

import torch

from planner.ledger import Ledger, new_id
from planner.models.kernels import kernel_target
from planner.optimizers import observed_name
from planner.records import Line, ProbeConfig, Verdict
from planner.shapes import InputShape, read_shape
from probes.census import OpCensus, census_fields, precision_flags
from probes.checkpoint import dir_size
from probes.memory import LiveTensorTracker, PhaseMeter, reading_notes
from probes.pilot import cuda_allocator_model, environment, is_oom, last_line, model_libraries
from probes.positions import position_limit

DEFAULT_STEADY_UPDATES = 8


def optimizer_name(optimizer) -> str:
    """The planner's optimizer names for the ones it sizes (planner/optimizers.py); otherwise the class name,
    lowercased."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate and Lightning wrap the torch optimizer
    name = type(inner).__name__.lower()
    if name == "adamw" and inner.defaults.get("fused"):
        return "adamw_fused"
    return observed_name(name)


def state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def batch_shape(args, kwargs) -> InputShape | None:
    """The batch of a model call, read by role (planner/shapes.py): its token ids (the first integer tensor of two
    or more dims), else its first float tensor of two or more dims (an image's channels are no sequence)."""
    tensors = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2]
    ids = [t for t in tensors if not t.is_floating_point() and not t.is_complex()]
    t = (ids or tensors or [None])[0]
    return None if t is None else read_shape(t.shape, t.is_floating_point() or t.is_complex())


NESTING = ("eval", "save", "export")  # phases a loop may open inside one another (an update never nests)
PEAKS = ("peak_allocated_bytes", "peak_reserved_bytes", "simulated_reserved_bytes", "device_used_bytes",
         "context_bytes")


def joined(readings: list[dict]) -> dict:
    """One reading of a phase measured in segments: the first's baseline and start, the largest peaks, the
    seconds and OOMs added."""
    out = dict(readings[0])
    for r in readings[1:]:
        for k in PEAKS:
            if r.get(k) is not None:
                out[k] = r[k] if out.get(k) is None else max(out[k], r[k])
        out["seconds"] += r["seconds"]
        if r.get("num_ooms_delta") is not None:
            out["num_ooms_delta"] = (out.get("num_ooms_delta") or 0) + r["num_ooms_delta"]
    return out


def folder_bytes(path: str) -> int | None:
    """Bytes of a saved file or folder; None when nothing is there."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return dir_size(path) if os.path.isdir(path) else None


class PhaseRecorder:
    """Measures the phases of someone else's loop and appends one ledger line per phase."""

    def __init__(self, ledger: str = "rentplan.db", workload: str | None = None, params: dict | None = None,
                 source: str = "script", steady_updates: int = DEFAULT_STEADY_UPDATES, census: bool = True,
                 eval_seq_len: int | None = None, cap_bytes: int | None = None, cap: str = ""):
        self.ledger_path = str(ledger)
        self.workload, self.params = workload, dict(params or {})
        self.source, self.steady_updates, self.want_census = source, steady_updates, census
        self.eval_seq_len, self.cap_bytes, self.cap = eval_seq_len, cap_bytes, cap
        self.run_id, self.probe_id = new_id("r"), new_id("p")
        self.config: dict = {}
        self.cfg: ProbeConfig | None = None
        self.env: dict = {}
        self.tracker: LiveTensorTracker | None = None
        self._tracking = False  # the tracker's mode is on the stack
        self.meter: PhaseMeter | None = None
        self.phase: str | None = None  # what the loop is doing now
        self._paused: list[str] = []  # phases a nested one paused (eval while a save runs), innermost last
        self._segments: dict[str, list[dict]] = {}  # readings of a paused phase before its pause
        self.written: set[str] = set()
        self.failed = self.ended = False
        self.updates = 0
        self.census_update: int | None = None
        self._census: OpCensus | None = None
        self._census_profile: dict = {}
        self._setup: dict = {}
        self._steady: list[dict] = []  # one reading per steady update
        self._loss_first: float | None = None
        self.train_shape: InputShape | None = None  # the largest batch the model was called on, by role
        self.eval_shape: InputShape | None = None
        self._started = self._now()

    # --- the loop's events ---------------------------------------------------------------------------------

    def begin(self, model: torch.nn.Module, device: torch.device | str, planned_updates: int | None = None,
              **config) -> None:
        """The loop is about to train `model` on `device`. config: ProbeConfig fields read from the trainer."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.config = {"workload": self.workload, "params_json": json.dumps(self.params, sort_keys=True),
                       "device": str(device), "mode": "measured", "cap": self.cap, "cap_bytes": self.cap_bytes,
                       **config}
        self.env = environment(device)
        if device.type == "cpu":  # entered here, left in end()/fail(): every tensor made meanwhile is counted
            # The cap counts live bytes here, not CUDA's rule (probe/estimate): the user's model exists before
            # the recorder, and an allocator-model OOM while counting it would come before any line.
            self.tracker = LiveTensorTracker(self.cap_bytes, allocator=cuda_allocator_model())
            self.tracker.__enter__()
            self._tracking = True
            for t in list(model.parameters()) + list(model.buffers()):  # made before the recorder: counted now
                self.tracker._track(t)
        elif self.cap_bytes:
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.cap_bytes / self.env["device_total_bytes"]),
                                                       device)
        self.meter = PhaseMeter(device, self.tracker)
        params = list(model.parameters())
        counters = self.meter.held()  # what is held now: the model (and data) before training
        if self.tracker is not None:
            counters["peak_allocated_bytes"] = self.tracker.live
        self._setup = {
            **counters, "baseline_allocated_bytes": counters.get("peak_allocated_bytes"),
            "param_count": sum(p.numel() for p in params),
            "trainable_param_count": sum(p.numel() for p in params if p.requires_grad),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            **dict(zip(("position_limit", "position_limit_basis"), position_limit(None, model))),
            "detail": f"the model as the {self.source} loop built it, held when rentplan began watching (setup's "
                      "time and peak not measured)",
        }
        if self.want_census and (planned_updates is None or planned_updates >= 3):
            self.census_update = 2  # the second update: the optimizer state exists, as in every steady update
        self.phase = "setup"
        self.mark()

    def saw_call(self, training: bool, shape: InputShape | None) -> None:
        """The model was called on a batch of `shape` (train or eval): the most positions, then the largest batch,
        is the shape a phase is sized at."""
        if shape is None:
            return
        attr = "train_shape" if training else "eval_shape"
        old = getattr(self, attr)
        if old is None or (shape.positions, shape.batch) > (old.positions, old.batch):
            setattr(self, attr, shape)

    def update_begin(self) -> None:
        if not self.active:
            return
        self.phase = "first_step" if self.updates == 0 else "steady"
        self.mark()
        if self.updates + 1 == self.census_update:
            self._census = OpCensus()
            self._census.__enter__()

    def update_end(self, loss=None) -> None:
        """One optimizer update ended (its step taken). loss: the last micro-batch's loss, if the loop has it."""
        if not self.active:
            return
        self.updates += 1
        reading = self.read()
        value = self._loss_value(loss)
        if self._census is not None:
            self._census.__exit__(None, None, None)
            self._census_profile = {self._census_key(): {
                **self._census.profile(), **precision_flags()}}
            self._census = None
        if value is not None and not math.isfinite(value):  # judged on every update, the census one included
            phase = "first_step" if self.updates == 1 else "steady"
            self._fix_config()
            if "setup" not in self.written:
                self._write("setup", self._setup)
            self._write(phase, {**reading, "verdict": Verdict.NONFINITE, "nonfinite_update": self.updates,
                                "detail": f"non-finite loss at update {self.updates}"})
            self.failed = True
            self._stop()
            return
        if self.updates == 1:
            self._loss_first = value
            self._fix_config()
            self._write("setup", self._setup)
            self._write("first_step", {**reading, "loss_first": value, "loss_last": value,
                                       "optimizer_state_bytes": self.config.get("_optimizer_state_bytes")})
        elif self.updates == self.census_update:
            pass  # its time and memory rode beside the census: in no line
        elif "steady" not in self.written:
            self._steady.append({**reading, "loss": value})
            if len(self._steady) >= self.steady_updates:
                self._write_steady()
        self.phase = None
        self.mark()

    def optimizer_state(self, optimizer) -> None:
        """Read the optimizer's state size right after its first step."""
        if self.updates == 0 and "_optimizer_state_bytes" not in self.config:
            self.config["_optimizer_state_bytes"] = state_bytes(optimizer)
            self.config.setdefault("optimizer", optimizer_name(optimizer))

    def phase_begin(self, phase: str) -> None:
        if not self.active or self.phase == phase or phase in self._paused:
            return
        if self.phase in NESTING:  # eval open when a save starts: eval pauses, its reading so far is kept
            self._segments.setdefault(self.phase, []).append(self.read())
            self._paused.append(self.phase)
        self.phase = phase
        self.mark()

    def phase_end(self, phase: str, **fields) -> None:
        if not self.active or self.phase != phase:
            return
        reading = joined(self._segments.pop(phase, []) + [self.read()])
        self.phase = self._paused.pop() if self._paused else None  # the paused phase resumes
        if phase not in self.written and self.cfg is not None:
            if phase == "eval":
                fields = {**self._eval_shape_fields(), **fields}
            self._write(phase, {**reading, **fields})
        self.mark()

    @contextlib.contextmanager
    def during(self, phase: str, path: str | None = None):
        """`with recorder.during("export", path="out/"): trainer.save_model("out/")`: one phase, measured, also
        after training ended (the tracker counts again for the phase)."""
        reopened = self.ended and not self.failed and self.meter is not None
        if reopened:
            self.ended = False
            if self.tracker is not None:
                self.tracker.__enter__()
                self._tracking = True
        try:
            self.phase_begin(phase)
            try:
                yield self
            except BaseException as e:
                self.fail(e)
                raise
            self.phase_end(phase, **({"checkpoint_bytes": folder_bytes(path)} if path else {}))
        finally:
            if reopened:
                self._stop()

    def fail(self, exc: BaseException) -> None:
        """The loop raised: the phase it was in gets its verdict (oom, error); the exception goes on."""
        if not self.active:
            return
        if self._census is not None:
            self._census.__exit__(None, None, None)
            self._census = None
        phase = self.phase or ("first_step" if self.updates == 0 else "steady")
        verdict = Verdict.OOM if is_oom(exc) else Verdict.ERROR
        reading = self.read()
        self._fix_config()
        if "setup" not in self.written:
            self._write("setup", self._setup)
        self._write(phase, {**reading, "verdict": verdict, "detail": last_line(exc)})
        self.failed = True
        self._stop()

    def end(self) -> None:
        """Training ended: the steady line, from the updates there were, if it is not written yet; an eval still
        open (a loop that ends on its last evaluation) ends here."""
        if self.active and self.cfg is not None and "steady" not in self.written and self._steady:
            self._write_steady()
        while self.active and self.phase in NESTING:
            self.phase_end(self.phase)
        self._stop()

    # --- measuring -------------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.meter is not None and not self.failed and not self.ended

    def mark(self) -> None:
        self._mark_baseline = self.meter.start()
        self._mark_t = time.perf_counter()
        self._mark_at = self._now()

    def read(self) -> dict:
        self.meter.synchronize()
        seconds = time.perf_counter() - self._mark_t
        return {**self._mark_baseline, **self.meter.stop(), "seconds": seconds, "started_at": self._mark_at}

    def _census_key(self) -> str:
        if self.meter.cuda:
            major, minor = torch.cuda.get_device_capability(self.meter.device)
            return kernel_target(f"{major}.{minor}")
        return "cpu"

    @staticmethod
    def _loss_value(loss) -> float | None:
        if loss is None:
            return None
        if isinstance(loss, dict):
            loss = loss.get("loss")
        if isinstance(loss, torch.Tensor):
            return float(loss.detach().float().mean())
        return float(loss) if isinstance(loss, (int, float)) else None

    @staticmethod
    def _now() -> str:
        return datetime.now(timezone.utc).isoformat(timespec="seconds")

    # --- lines -------------------------------------------------------------------------------------------

    def _fix_config(self) -> None:
        """The run's configuration, from what the trainer said and what the model was called with."""
        if self.cfg is not None:
            return
        cfg = {k: v for k, v in self.config.items() if not k.startswith("_")}
        shape = self.train_shape
        mb, seq = (shape.batch, shape.positions) if shape else (cfg.get("micro_batch", 1), cfg.get("seq_len", 1))
        cfg["micro_batch"], cfg["seq_len"] = mb, seq
        cfg.setdefault("eval_micro_batch", mb)
        cfg["eval_seq_len"] = self.eval_seq_len or cfg.get("eval_seq_len") or seq
        cfg["steady_updates"] = self.steady_updates
        names = {f.name for f in dataclasses.fields(ProbeConfig)}
        self.cfg = ProbeConfig(**{k: v for k, v in cfg.items() if k in names})

    def _eval_shape_fields(self) -> dict:
        """An eval that ran a longer sequence (or larger batch) than configured is sized at what it ran."""
        if self.eval_shape is None:
            return {}
        mb, seq = self.eval_shape.batch, self.eval_shape.positions
        if seq > self.cfg.eval_seq_len or (seq == self.cfg.eval_seq_len and mb > self.cfg.eval_micro_batch):
            ran = (f"{self.eval_shape.text} ({self.eval_shape.positions_text})" if self.eval_shape.kind == "image"
                   else f"micro-batch {mb} × seq {seq}")
            return {"_eval_shape": (mb, seq), "detail": (
                f"eval ran {ran}; the run's configured eval shape was "
                f"{self.cfg.eval_micro_batch} × {self.cfg.eval_seq_len}")}
        return {}

    def _write_steady(self) -> None:
        rows = self._steady
        times = [r["seconds"] for r in rows]
        peak = {k: max((r[k] for r in rows if r.get(k) is not None), default=None) for k in PEAKS}
        losses = [r["loss"] for r in rows if r["loss"] is not None]
        census = " (one more update was set apart for the op census)" if self._census_profile else ""
        self._write("steady", {
            **peak, "baseline_allocated_bytes": rows[0].get("baseline_allocated_bytes"),
            "num_ooms_delta": sum(r.get("num_ooms_delta") or 0 for r in rows) if self.meter.cuda else None,
            "seconds": sum(times), "started_at": rows[0]["started_at"],
            "update_times_s": json.dumps(times), "update_s": statistics.median(times),
            "loss_first": self._loss_first, "loss_last": losses[-1] if losses else None,
            "detail": f"{len(rows)} updates of the {self.source} loop{census}",
            **census_fields(self._census_profile)})

    def _write(self, phase: str, fields: dict) -> None:
        fields = dict(fields)
        verdict = fields.pop("verdict", Verdict.OK)
        fields.pop("loss", None)
        cfg = self.cfg
        shape = fields.pop("_eval_shape", None)
        if shape is not None:
            cfg = dataclasses.replace(cfg, eval_micro_batch=shape[0], eval_seq_len=shape[1])
        started = fields.pop("started_at", None) or self._started
        fields["detail"] = "; ".join(filter(None, [fields.get("detail"),
                                                   reading_notes(self.meter.device, phase, cfg.optimizer)]))
        read = (self.eval_shape or self.train_shape) if phase == "eval" else self.train_shape
        line = Line.from_config(cfg, run_id=self.run_id, probe_id=self.probe_id, phase=phase,
                                verdict=Verdict(verdict).value, started_at=started, source=self.source,
                                input_shape=read.text if read else "", libraries=model_libraries(),
                                rank=int(os.environ.get("RANK", 0)), **self.env, **fields)
        with Ledger(self.ledger_path) as led:
            led.append(line)
        self.written.add(phase)

    def _stop(self) -> None:
        """Leave the tracker's mode (its counts stay right: storages it knows still report their death)."""
        self.ended = True
        if self.tracker is not None and self._tracking:
            with contextlib.suppress(Exception):  # not on top of the mode stack: nothing more to count anyway
                self.tracker.__exit__(None, None, None)
        self._tracking = False
