"""One pilot of one configuration, phase by phase, in the current process (a worker).

Each phase: synchronize and reset the peaks, record the baseline, run, synchronize, read the peaks.
A phase that fails (OOM, non-finite loss, exception) still yields its line; later phases are not run.
`emit(kind, payload)` sends ("env", dict), ("phase", name) and ("line", dict) to the parent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from collections import Counter
from datetime import datetime, timezone
from typing import Callable

import torch

from planner.errors import InputError
from planner.models.allocator import AllocatorConfig, CachingAllocator
from planner.models.kernels import TARGETS, kernel_target
from planner.records import Line, ProbeConfig, Verdict
from probes import checkpoint
from probes.census import OpCensus, census, census_fields, precision_flags
from probes.kernels import target_kernels
from probes.loop import NonFinite, Trainer
from probes.memory import LiveTensorTracker, PhaseMeter, host_side, reading_notes
from probes.positions import position_limit
from probes.workloads import load_workload

Emit = Callable[[str, object], None]
TRAIN_WORKER_PHASES = ("setup", "first_step", "steady", "eval", "save", "export")


def cuda_allocator_model(limit_bytes: int | None = None):
    """The CUDA caching allocator model, configured as PYTORCH_CUDA_ALLOC_CONF asks, under a memory limit as
    set_per_process_memory_fraction sets one (--cap). None: an option the model does not follow; the line then
    has no simulated reserved figure (and a cap counts allocated bytes)."""
    try:
        return CachingAllocator(AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), limit_bytes))
    except ValueError:
        return None


def available_device(device: str, ranks: int = 1) -> str:
    """'auto' -> cuda when present, else cpu; 'cuda[:N]' only when this machine has that device; `ranks` ranks on
    CUDA only when each has a GPU of its own (rank r runs on cuda:r). Asked in the command's own process, never in
    one that forks workers (probes/warm.py says why)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            return device
    if not torch.cuda.is_available():
        raise InputError(f"--device {device}: no CUDA device on this machine (torch {torch.__version__}). "
                         "Use --device cpu, or run on a GPU machine with the CUDA build of torch.")
    count = torch.cuda.device_count()
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= count:
        raise InputError(f"--device {device}: this machine has {count} CUDA device(s).")
    if ranks > 1 and index:
        raise InputError(f"--device {device} with --nproc {ranks}: rank r runs on cuda:r, from cuda:0. Give --device "
                         f"cuda, and choose the GPUs with CUDA_VISIBLE_DEVICES (e.g. CUDA_VISIBLE_DEVICES={index},"
                         f"{index + 1} for two ranks from cuda:{index}).")
    if ranks > count:
        raise InputError(f"--nproc {ranks}: this machine has {count} CUDA device(s), and each rank needs its own "
                         f"(rank r runs on cuda:r). Use --nproc {count} or fewer here, or --device cpu for ranks "
                         f"on the CPU (gloo), or estimate --strategy ... --nproc {ranks} to size it without the GPUs.")
    return device


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, total = props.name, props.total_memory
    else:
        name = cpu_name()
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": str(device), "device_name": name, "device_total_bytes": int(total),
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "host": socket.gethostname(),
    }


MODEL_LIBRARIES = ("transformers", "peft", "bitsandbytes", "timm", "torchvision", "lightning", "accelerate")


def model_libraries() -> str:
    """The model-code libraries this process has imported, with their installed versions: HF's code version moves
    memory (gpt2-large: -0.2 % under transformers 4.46, +5 % under 5.25), so a line says which code it ran."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in MODEL_LIBRARIES:
        if name in sys.modules:
            try:
                found.append(f"{name} {version(name)}")
            except PackageNotFoundError:
                found.append(f"{name} {getattr(sys.modules[name], '__version__', 'unknown')}")
    return ", ".join(found)


def is_oom(exc: BaseException) -> bool:
    """OOM from the CUDA/CPU allocator, the cap tracker, cuBLAS or HIP, recognised by type or message."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc)
    return any(s in text for s in (
        "CUDA out of memory", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED",
        "HIP out of memory", "DefaultCPUAllocator: can't allocate memory", "not enough memory",
    ))


def last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[-1][:500] if text else type(exc).__name__


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds for a tensor: a DTensor's local shard, else the tensor itself."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _map(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    return obj


def _as_meta(state):
    """Shapes, strides and dtypes of a state's tensors, on meta: no memory, and nothing the tracker sees."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _map(state, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"))


def _materialise(state):
    """Every tensor of a (meta) checkpoint as a new tensor under the active modes, as torch.load makes them.
    Scalars (optimizer steps) get a value: AdamW reads its step with .item(), and fake tensors made from a
    Python number keep it."""
    return _map(state, lambda t: torch.tensor(1, dtype=t.dtype) if t.dim() == 0 else
                torch.empty_strided(t.shape, t.stride(), dtype=t.dtype))


def _tensor_meta(t: torch.Tensor, storages: dict) -> tuple:
    st = t.untyped_storage()
    return (type(t).__name__, str(t.device), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(),
            t.requires_grad, st.nbytes(), storages.setdefault(id(st), len(storages)))


def _meta_tree(obj, storages: dict):
    if isinstance(obj, torch.Tensor):
        return _tensor_meta(obj, storages)
    if isinstance(obj, dict):
        return tuple((k, _meta_tree(v, storages)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, *(_meta_tree(v, storages) for v in obj))
    return ("value", type(obj).__name__, repr(obj))


def update_signature(trainer, optimizer: bool = True) -> tuple:
    """What an update's ops can depend on in a built-in workload, as metadata: the open window's batches, every
    parameter, buffer and gradient of the model and its modules' modes, and (optimizer=True; its forward and
    backward passes do not read them) the optimizer's state and settings but the scheduled learning rate, with
    which storages they share. Two states with equal signatures run the same ops on tensors of the same shapes
    (Pilot.replayed_update)."""
    storages: dict = {}
    model = trainer.model
    out = (
        len(trainer.window["indices"]), _meta_tree(trainer._batches, storages),
        tuple((n, _tensor_meta(p, storages), None if p.grad is None else _tensor_meta(p.grad, storages))
              for n, p in model.named_parameters(remove_duplicate=False)),
        tuple((n, _meta_tree(b, storages)) for n, b in model.named_buffers(remove_duplicate=False)),
        tuple((n, m.training, type(m).__name__) for n, m in model.named_modules(remove_duplicate=False)),
        trainer.amp_dtype, trainer.scaler is None, trainer.cfg.key(),
    )
    if not optimizer:
        return out
    groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
              for g in trainer.optimizer.param_groups]
    index = {id(p): i for i, p in enumerate(p for g in trainer.optimizer.param_groups for p in g["params"])}
    return (*out, type(trainer.optimizer).__name__, _meta_tree(groups, storages),
            tuple(sorted((index[id(p)], _meta_tree(s, storages)) for p, s in trainer.optimizer.state.items())))


@dataclasses.dataclass
class MicroRecord:
    """The first update's forward and backward passes as an estimate counted them (Pilot.first_update)."""

    window: object  # Recording of begin_window
    before: tuple  # update_signature(optimizer=False) once the window began
    micro: object  # Recording of the micro-steps
    rows: Counter  # the census of the micro-steps
    launches: int
    backends: dict  # attention kernels they ran
    grads: list  # (parameter index, shape, stride, dtype, recorded key, storage bytes): what they left alive


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class Pilot:
    """Holds the state one phase hands to the next."""

    replay_updates = True  # estimates: resume's update counted from the steady update's record where it may be

    def __init__(self, cfg: ProbeConfig, workdir: str, emit: Emit, run_id: str, probe_id: str, rank: int = 0):
        self.cfg, self.workdir, self.emit = cfg, workdir, emit
        self.run_id, self.probe_id, self.rank = run_id, probe_id, rank
        self.device = torch.device(cfg.device)
        self.fake = cfg.mode == "estimated"
        if self.fake and self.device.type != "cpu":
            raise ValueError("estimates run CPU kernels under fake tensors: use device cpu")
        self.workload = load_workload(cfg.workload, json.loads(cfg.params_json))
        self.env = environment(self.device)
        if self.fake:
            kernels = f"{cfg.target} kernels" if cfg.target and cfg.target != "cpu" else "CPU kernels"
            self.env["device_name"] += f" (FakeTensorMode: {kernels}, no memory touched" + (
                f"; rank 0 of {cfg.world_size} on a fake process group)" if cfg.world_size > 1 else ")")
        emit("env", self.env)
        self.tracker = (LiveTensorTracker(cfg.cap_bytes, track_resizes=cfg.strategy == "fsdp",
                                          allocator=cuda_allocator_model(cfg.cap_bytes))
                        if self.device.type == "cpu" else None)
        if self.device.type == "cuda" and cfg.cap_bytes:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.cap_bytes / self.env["device_total_bytes"]),
                                                       self.device)
        self.meter = PhaseMeter(self.device, self.tracker, self.fake)
        self.trainer: Trainer | None = None
        self.losses: list[float] = []
        self._checkpoint: dict | None = None  # estimates: the state a checkpoint would hold
        self.census: dict[str, dict] = {}
        self.kernels = None  # estimates for a GPU target: the mode routing its kernels
        self._micro_record: MicroRecord | None = None  # estimates: first_step's micro-steps as counted
        self._update_record = None  # estimates: the steady update as the tracker counted it (replayed_update)
        self.replayed_micro = False  # whether steady's micro-steps were counted from first_step's record
        self.replayed = False  # whether resume's update was counted from steady's record rather than traced

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.workdir, f"{self.run_id}.ckpt.pt")

    # --- phases: each returns the observed fields it adds to its line ---

    def new_trainer(self) -> Trainer:
        return Trainer(self.workload, self.cfg, self.device, fake=self.fake)

    def steps(self) -> dict:
        """Each phase's step, named: what a line's phase runs is this table, not a method looked up by name."""
        return {"setup": self.setup, "first_step": self.first_step, "steady": self.steady, "eval": self.evaluate,
                "save": self.save, "export": self.export, "resume": self.resume}

    def setup(self) -> dict:
        self.trainer = self.new_trainer()
        params = list(self.trainer.model.parameters())
        limit, basis = position_limit(self.workload, self.trainer.model)
        return {
            "position_limit": limit, "position_limit_basis": basis,
            "param_count": sum(p.numel() for p in params),
            "trainable_param_count": sum(p.numel() for p in params if p.requires_grad),
            "param_bytes": sum(_local_bytes(p) for p in params),  # this rank's share when sharded
        }

    def first_step(self) -> dict:
        res = self.first_update() if self.fake else self.trainer.train_update()
        self.losses.append(res.loss)
        opt_bytes = sum(_local_bytes(t) for s in self.trainer.optimizer.state.values()
                        for t in s.values() if isinstance(t, torch.Tensor))
        loss = None if self.fake else res.loss
        return {"optimizer_state_bytes": opt_bytes, "loss_first": loss, "loss_last": loss}

    def steady(self) -> dict:
        times = []
        for _ in range(1 if self.fake else self.cfg.steady_updates):  # estimates: every update is alike
            self.meter.synchronize()
            t0 = time.perf_counter()
            if self.fake:  # an estimate counts its ops on this very update: the census holds no tensor, and a
                counter = OpCensus()  # test checks the peaks are the same without it (test_estimate.py)
                with counter:
                    res = self.recorded_update(counter)
                self.census = {self.cfg.target or "cpu": {
                    **counter.profile(), **precision_flags()}}
            else:
                res = self.trainer.train_update()
            self.meter.synchronize()  # GPU work is asynchronous: stop the clock only when it is done
            times.append(time.perf_counter() - t0)
            self.losses.append(res.loss)
        work = census_fields(self.census)  # a measured run's: counted in a fake pass just before this phase
        if self.fake:  # nothing ran for real: no times, no losses
            met = self.fake_mode.unverified_note(self.cfg.target not in ("", "cpu", None))
            return {**work, "loss_first": None, "loss_last": None,
                    "detail": f"estimated: one update under fake tensors with {self.kernel_note()} (no time measured)"
                              + (f"; ops whose estimate may differ from the kernel: {met}" if met else "")
                              + (f"; {held}" if (held := self.memory_note()) else "")}
        return {**work, "update_times_s": json.dumps(times), "update_s": _median(times),
                "loss_first": self.losses[0], "loss_last": self.losses[-1]}

    def evaluate(self) -> dict:
        loss = self.trainer.evaluate(self.cfg.eval_micro_batch, self.cfg.eval_seq_len).loss
        return {"loss_last": None if self.fake else loss}

    def save(self) -> dict:
        if self.fake:  # torch.save writes tensors from their storages: no tensor memory beyond the state
            state = checkpoint.training_state(self.trainer)
            # What the file would hold, kept as shapes only (meta, untracked): resume materialises it again.
            self._checkpoint = {**_as_meta(state), "update": 1 + self.cfg.steady_updates,
                                "position": (1 + self.cfg.steady_updates) * self.cfg.grad_accum}
            return {"checkpoint_bytes": _tensor_bytes(state), "detail": "estimated: state size, no file written"}
        return {"checkpoint_bytes": checkpoint.save(self.trainer, self.ckpt_path)}

    def export(self) -> dict:
        if self.fake:  # FSDP: the gather to rank 0 is what costs memory, so it runs
            if self.cfg.strategy == "fsdp":
                weights, what = checkpoint.gathered_weights(self.trainer), "full weights gathered to rank 0"
            elif (adapter := checkpoint.adapter_weights(self.trainer)) is not None:  # what checkpoint.export ships
                weights, what = adapter, "the LoRA adapter's size"
            else:
                weights, what = checkpoint.weights(self.trainer), "weights size"
            return {"checkpoint_bytes": _tensor_bytes(weights), "detail": f"estimated: {what}, no file written"}
        path = os.path.join(self.workdir, f"{self.run_id}.model.safetensors")
        size = checkpoint.export(self.trainer, path)  # weights only (gathered to rank 0 when sharded)
        return {"checkpoint_bytes": size}

    def resume(self) -> dict:
        # A fresh process: build, load the full checkpoint (weights_only=True), take one update. An estimate
        # resumes in the same worker once the training state is gone (its fake tensors freed: the tracker is
        # back to what a fresh process holds), from the checkpoint's shapes kept at save.
        if self.fake:
            if self._checkpoint is None:
                raise RuntimeError("an estimate resumes from the state its save phase kept: run save first")
            self.trainer = None
            gc.collect()
        self.trainer = self.new_trainer()
        # torch.load reads every tensor of the file into host memory, then they are copied onto the device
        if self.fake:
            state = self._checkpoint
            if self.cfg.strategy == "fsdp":  # as checkpoint.load: shards restored in place, the rest from the file
                checkpoint.load_sharded(self.trainer, None)
                state = {**state, "model": None, "optimizer": None, "grads": None}
            with host_side():  # read into host memory, as checkpoint.load reads the file
                loaded = _materialise(state)
            checkpoint.restore_from_host(self.trainer, loaded)
            del loaded
        else:
            checkpoint.load(self.trainer, self.ckpt_path)
        expected = 1 + self.cfg.steady_updates
        if self.trainer.update != expected:
            raise RuntimeError(f"resumed at update {self.trainer.update}, expected {expected}")
        res = self.replayed_update() if self.fake else self.trainer.train_update()
        loss = None if self.fake else res.loss
        return {"loss_first": loss, "loss_last": loss,
                "detail": f"resumed at update {expected}, position {self.trainer.position - self.cfg.grad_accum}"}

    def libraries(self) -> str:
        """The model-code libraries the line ran under: none for a builtin: model (its code is rentplan's), whatever
        else this process has imported (a pilot in a long-lived process, a test's, may have imported transformers)."""
        return "" if self.cfg.workload.startswith("builtin:") else model_libraries()

    def memory_note(self) -> str:
        """The workload's own word on what its traced memory assumed (QLoRA's bitsandbytes version, probes/hf.py)."""
        note = getattr(self.trainer.workload, "memory_note", None)
        return note(self.trainer.model) if callable(note) else ""

    # --- estimates: updates counted from records of identical ones ---
    #
    # Tracing an update under fake tensors is most of an estimate's time, and an estimate traced three: first_step,
    # steady and resume. For a built-in workload (its code is ours: the ops of an update follow from the tensors'
    # metadata, the batches' and the settings, nothing else) the tracker records what it counts, and an identical
    # update later is counted by replaying that record into the allocator state it meets (LiveTensorTracker.replay):
    # - steady's forward and backward passes are first_step's (gradients are None before both; the optimizer is
    #   not read until the step): replayed with their census rows and attention kernels, the gradients they leave
    #   made as the fake tensors backward made; the optimizer step (first_step's made the state) is traced;
    # - resume's whole update is steady's (the same state, restored): replayed.
    # A replay is taken only when everything those ops could depend on is as it was when recorded: the window's
    # batches made the same storages in the same order, and the model's parameters, buffers and gradients, its
    # modules' modes and (for a whole update) the optimizer's state and settings but the scheduled learning rate
    # have the same metadata and aliasing (update_signature); otherwise the update is traced.
    # tests/test_estimate_replay.py runs grids both ways and finds every figure of every line equal.

    def replays_updates(self) -> bool:
        from probes.builtin import BUILTINS

        return (self.fake and self.replay_updates and self.tracker is not None
                and self.cfg.workload.startswith("builtin:")  # a file returning GPT(...) may patch its code
                and type(self.workload) in BUILTINS.values() and not hasattr(self.workload, "after_build")
                and self.cfg.strategy == "single" and self.cfg.world_size == 1 and self.cfg.cap_bytes is None
                and self.cfg.optimizer in ("adamw", "adamw_fused", "sgd", "adafactor"))

    def _begin_window(self):
        """Make the next window's batches (as train_update would first), recorded."""
        t = self.trainer
        with self.tracker.record() as rec:
            t.begin_window(list(range(t.position, t.position + self.cfg.grad_accum)))
        return rec

    def first_update(self):
        """The first update, its micro-steps recorded with their census (MicroRecord)."""
        if not self.replays_updates():
            return self.trainer.train_update()
        t = self.trainer
        window = self._begin_window()
        before = update_signature(t, optimizer=False)
        counter = OpCensus()
        ran = dict(self.kernels.backends) if self.kernels is not None else {}
        with counter, self.tracker.record() as micro:
            while t.window["done"] < len(t.window["indices"]):
                t.micro_step()
        grads = self._recorded_grads(micro)
        if grads is not None:
            backends = {k: n - ran.get(k, 0) for k, n in (self.kernels.backends if self.kernels else {}).items()}
            self._micro_record = MicroRecord(window, before, micro, counter.rows, counter.launches,
                                             {k: n for k, n in backends.items() if n}, grads)
        return t.train_update()  # the window's micro-steps are done: its optimizer step

    def _recorded_grads(self, micro) -> list | None:
        """The gradients the micro-steps left, when they are all they left: each a whole fake storage of its own
        that empty_strided remakes. None otherwise (nothing is replayed)."""
        from torch._subclasses.fake_tensor import FakeTensor

        alive = set(micro.alive())
        grads = []
        for i, p in enumerate(self.trainer.model.parameters()):
            g = p.grad
            if g is None:
                continue
            st = g.untyped_storage()
            if (type(g) is not FakeTensor or g.constant is not None or g.requires_grad or g.storage_offset()
                    or id(st) not in alive or g.fake_device != self.device):
                return None
            alive.discard(id(st))
            grads.append((i, tuple(g.shape), tuple(g.stride()), g.dtype, id(st), st.nbytes()))
        return grads if not alive else None

    def _replay_micro_steps(self, window, counter) -> bool:
        r = self._micro_record
        t = self.trainer
        if r is None or window.shape() != r.window.shape() or update_signature(t, optimizer=False) != r.before:
            return False
        from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager
        from torch.utils._python_dispatch import _disable_current_modes

        params = list(t.model.parameters())
        made = {}
        with _disable_current_modes():  # the gradients backward would leave, seen by no mode: the replay counts them
            for i, shape, stride, dtype, key, nbytes in r.grads:
                with in_kernel_invocation_manager(self.fake_mode):
                    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                if meta.untyped_storage().nbytes() != nbytes:  # a gradient over a larger storage: not remade
                    return False
                made[key] = (i, FakeTensor(self.fake_mode, meta, self.device))
        self.tracker.replay(r.micro, known=dict(zip(r.window.alive(), window.alive())),
                            bind={key: g for key, (_, g) in made.items()})
        for i, g in made.values():
            params[i].grad = g
        counter.rows.update(r.rows)
        counter.launches += r.launches
        for k, n in r.backends.items():
            self.kernels.backends[k] = self.kernels.backends.get(k, 0) + n
        t.window["done"] = len(t.window["indices"])
        t.window["loss_sum"] = float("nan")  # what fake micro-steps add up to
        self.replayed_micro = True
        return True

    def recorded_update(self, counter):
        """The steady update (its forward and backward replayed from first_step's where they may be), recorded."""
        if not self.replays_updates():
            return self.trainer.train_update()
        window = self._begin_window()
        before = update_signature(self.trainer)
        with self.tracker.record() as rec:
            self._replay_micro_steps(window, counter)
            res = self.trainer.train_update()
        self._update_record = (window, before, rec)
        return res

    def replayed_update(self):
        """Resume's update: steady's replayed where it may be, else traced."""
        record = self._update_record
        if record is None or not self.replays_updates():
            return self.trainer.train_update()
        window, before, rec = record
        mine = self._begin_window()
        if mine.shape() != window.shape() or update_signature(self.trainer) != before:
            return self.trainer.train_update()
        self.tracker.replay(rec, known=dict(zip(window.alive(), mine.alive())))
        self.replayed = True
        return self.trainer.skip_update()

    def kernel_note(self) -> str:
        if self.kernels is None:
            return "the CPU build's kernels"
        ran = ", ".join(f"{k} ×{n}" for k, n in sorted(self.kernels.backends.items())) or "none"
        return f"{self.cfg.target} kernels (attention: {ran}; fused dropout; CUDA autocast policy)"

    def count_work(self) -> dict[str, dict]:
        """The census of one update (FLOPs, bytes, launches) per kernel target, in a fake pass of its own, run
        between phases with every mode of this pilot set aside (the tracker must not see its fake tensors)."""
        from torch.utils._python_dispatch import _disable_current_modes

        out = {}
        for target in self.census_targets():
            kernels = lambda t=target: target_kernels(t)  # noqa: E731
            try:
                with _disable_current_modes():
                    out[target] = census(self.workload, self.cfg, kernels)
            except Exception as e:  # noqa: BLE001  a workload the census cannot trace still gets measured
                out[target] = {"error": last_line(e)}
        return out

    def census_targets(self) -> list[str]:
        """A measured run's census targets: on a CUDA GPU, its kernels; on a CPU, every GPU target."""
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            return [kernel_target(f"{major}.{minor}")]
        return [t for t in TARGETS if t != "cpu"]

    # --- running ---

    def run(self, phases: tuple[str, ...]) -> bool:
        """Run phases in order; stop after the first that does not end ok. True when all ended ok."""
        fake_mode = contextlib.nullcontext()
        if self.fake:
            from probes.fake import EstimateFakeMode

            fake_mode = self.fake_mode = EstimateFakeMode()
        # The tracker is entered last, so it sees every op first and counts the (fake) storages made below it.
        # Estimates for a GPU target run that GPU's attention, dropout and autocast (probes/kernels.py).
        with target_kernels(self.cfg.target if self.fake else None) as kernels, fake_mode:
            self.kernels = kernels
            with self.tracker if self.tracker is not None else contextlib.nullcontext():
                for phase in phases:
                    if not self._run_phase(phase):
                        return False
        return True

    def _run_phase(self, phase: str) -> bool:
        self.emit("phase", phase)
        if phase == "steady" and not self.fake:  # before the phase's meter starts: a hang here is still steady's
            self.census = self.count_work()
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        fields: dict = dict(self.meter.start())
        t0 = time.perf_counter()
        verdict, detail = Verdict.OK, ""
        try:
            fields.update(self.steps()[phase]())
        except NonFinite as e:
            verdict, detail = Verdict.NONFINITE, str(e)
            fields["nonfinite_update"] = e.update
        except Exception as e:  # noqa: BLE001  every failure becomes a verdict on the line
            verdict = Verdict.OOM if is_oom(e) else Verdict.ERROR
            detail = last_line(e)
            if verdict is Verdict.ERROR and os.environ.get("RENTPLAN_DEBUG"):
                traceback.print_exc()
        self.meter.synchronize()
        seconds = time.perf_counter() - t0
        fields.update(self.meter.stop())
        fields["seconds"] = seconds
        fields["detail"] = "; ".join(filter(None, [fields.get("detail") or detail,
                                                   reading_notes(self.device, phase, self.cfg.optimizer)]))
        line = Line.from_config(self.cfg, run_id=self.run_id, probe_id=self.probe_id, phase=phase, rank=self.rank,
                                verdict=verdict.value, started_at=started, libraries=self.libraries(), **self.env,
                                **fields)
        self.emit("line", line.to_dict())
        return verdict is Verdict.OK
