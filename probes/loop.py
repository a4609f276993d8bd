"""The one training loop that probes, checks and campaigns share.

An update = the micro-batches of one accumulation window. Each micro-batch's loss (a mean over its
counted targets) is weighted by its share of the window's counted targets, so the accumulated gradient
equals the gradient of one batch holding them all, ragged last windows included. With fp16 the scaler
unscales once before clipping and steps/updates once per update; bf16 has no scaler; the scheduler
steps once per optimizer update.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.records import ProbeConfig
from probes.workloads import count_targets

WARMUP_UPDATES = 10
CLIP_NORM = 1.0
SCALE_FLOOR = 1.0 / 2**14  # a loss scale driven this low means fp16 is overflowing on every step
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # everything kept in this dtype


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None):
    """Build parameters directly in `dtype` (a *-true precision): no full-precision copy exists first."""
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class NonFinite(RuntimeError):
    def __init__(self, update: int, what: str = "loss"):
        super().__init__(f"non-finite {what} at update {update}")
        self.update = update


class ResumeError(RuntimeError):
    """A checkpoint that cannot restore the exact training state."""


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


def warmup_lambda(update: int) -> float:
    return min(1.0, (update + 1) / WARMUP_UPDATES)


@dataclass
class UpdateResult:
    loss: float
    targets: int
    micro_batches: int


class Trainer:
    """Model, optimizer, scheduler and scaler for one configuration, with exact-resume state."""

    def __init__(self, workload, cfg: ProbeConfig, device: torch.device, split: str = "train", fake: bool = False):
        self.workload, self.cfg, self.device, self.split = workload, cfg, device, split
        self.fake = fake  # under FakeTensorMode: no values exist, so nothing is read back (.item())
        if cfg.precision in ("bf16", "bf16-true") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise RuntimeError("bf16 is not supported on this GPU (needs sm_80+); use fp16 or fp32")
        self.true_dtype = TRUE_DTYPES.get(cfg.precision)
        base_dtype = self.true_dtype or getattr(workload, "base_dtype", None)  # QLoRA: a bf16 base
        if fake:
            self.model = build_without_weights(workload, base_dtype)
        else:
            with torch.device(device), default_dtype(base_dtype):
                self.model = workload.build_model()
        if hasattr(workload, "after_build"):  # QLoRA: quantize the built base, then the adapter
            self.model = workload.after_build(self.model, device, fake)
        if self.true_dtype is not None and not fake:  # what a workload made in another float dtype (estimates
            self.model.to(self.true_dtype)              # made every float tensor in it already)
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        if any(t.device != device for t in tensors):  # a workload that ignored the device context
            self.model.to(device)
        if cfg.checkpointing:
            if not hasattr(self.model, "gradient_checkpointing_enable"):
                raise RuntimeError("checkpointing=on but the model has no gradient_checkpointing_enable()")
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.rank, self.world = 0, 1
        if cfg.strategy != "single":
            self.model = wrap_for_strategy(self.model, cfg.strategy, device)
            import torch.distributed as dist

            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(cfg.optimizer, params, cfg.lr, fake)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_lambda)
        # fp16 needs a scaler; under fake tensors it cannot run (it reads found-inf flags), and its state is tiny
        self.scaler = torch.amp.GradScaler(device.type) if cfg.precision == "fp16" and not fake else None
        self.amp_dtype = AMP_DTYPES.get(cfg.precision)
        self.update = 0  # optimizer updates done
        self.position = 0  # index of the next micro-batch in the data stream
        self.window: dict | None = None  # the accumulation window in progress
        self._batches: list[dict] | None = None

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None)

    def batch(self, index: int, split: str | None = None, micro_batch: int | None = None,
              seq_len: int | None = None) -> dict:
        # Data replicas read disjoint micro-batches: global index = index × world + rank.
        index = index * self.world + self.rank
        args = (split or self.split, index, micro_batch or self.cfg.micro_batch, seq_len or self.cfg.seq_len)
        with self.real_tensors():  # data is small and made for real, also under estimates
            batch = self.workload.make_batch(*args)
            if self.true_dtype is not None:  # float inputs in the model's dtype (token ids stay integers)
                batch = {k: (v.to(self.true_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                         for k, v in batch.items()}
            return batch

    def real_tensors(self):
        """Under fake tensors, a context where ops run for real (data, target counts); else a no-op."""
        if not self.fake:
            return contextlib.nullcontext()
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        return unset_fake_temporarily()

    # An update is a window of micro-batches: begin (fetch and count), micro-steps, finish (optimizer step).
    # The window's progress and the partial gradients are part of the checkpoint, so a run can stop and
    # resume exactly even in the middle of an accumulation window.

    def begin_window(self, indices: list[int]) -> None:
        batches = [self.batch(i) for i in indices]
        with self.real_tensors():
            counts = [count_targets(self.workload, b) for b in batches]
        if sum(counts) <= 0:
            raise RuntimeError(f"update {self.update + 1}: no counted target in its micro-batches {indices}")
        self.window = {"indices": list(indices), "counts": counts, "done": 0, "loss_sum": 0.0}
        self._batches = batches

    def micro_step(self) -> float:
        w = self.window
        i = w["done"]
        b = self._batches[i] if self._batches is not None else self.batch(w["indices"][i])
        n, total = w["counts"][i], sum(w["counts"])
        # DDP all-reduces once per update: on the window's last micro-batch (the planner times it so)
        last = i == len(w["indices"]) - 1
        sync = self.model.no_sync() if self.cfg.strategy == "ddp" and not last else contextlib.nullcontext()
        with sync:
            with self.autocast():
                loss = self.workload.compute_loss(self.model, to_device(b, self.device))
            value = float("nan") if self.fake else float(loss.detach())
            if not self.fake and not math.isfinite(value):
                raise NonFinite(self.update + 1)
            weighted = loss * (n / total)  # mean over the window's counted targets, not a naive /K
            (self.scaler.scale(weighted) if self.scaler else weighted).backward()
        w["loss_sum"] += value * n
        w["done"] += 1
        return value

    def finish_window(self) -> UpdateResult:
        w = self.window
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # once, right before clipping
        # Plain tensors take the foreach kernels on CUDA and CPU; fake ones fail torch's type check and fall back
        # to one norm and one multiply per parameter, which no real run does: ask for foreach as they get it.
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP_NORM, foreach=True if self.fake else None)
        if self.scaler:
            self.scaler.step(self.optimizer)  # skips the step itself when grads overflowed
            self.scaler.update()
            if self.scaler.get_scale() < SCALE_FLOOR:
                raise NonFinite(self.update + 1, "gradients (fp16 loss scale collapsed)")
        else:
            with _UnknownValuesAreOne() if self.fake else contextlib.nullcontext():
                self.optimizer.step()
        self.scheduler.step()  # once per optimizer update, never per micro-batch
        # DDP's gradients are views into its all-reduce buckets: zero them in place. Set to None, the next
        # window's no_sync backward would allocate a second gradient copy beside the buckets.
        self.optimizer.zero_grad(set_to_none=self.cfg.strategy != "ddp")
        self.update += 1
        self.position = w["indices"][-1] + 1
        total = sum(w["counts"])
        self.window, self._batches = None, None
        return UpdateResult(w["loss_sum"] / total, total, len(w["indices"]))

    def train_update(self, indices: list[int] | None = None, stop_after: int | None = None) -> UpdateResult | None:
        """One optimizer update over `indices` (default: the next grad_accum micro-batches). With stop_after,
        stop once that many micro-batches of the window are done (returns None; the window stays open)."""
        if self.window is None:
            self.begin_window(indices if indices is not None else
                              list(range(self.position, self.position + self.cfg.grad_accum)))
        while self.window["done"] < len(self.window["indices"]):
            if stop_after is not None and self.window["done"] >= stop_after:
                return None
            self.micro_step()
        return self.finish_window()

    def train_epoch(self, n_micro_batches: int, start: int = 0) -> list[UpdateResult]:
        """A pass over n micro-batches in windows of grad_accum; a short last window is normalised by its own
        counted targets, and gradients are cleared at the boundary (nothing leaks into the next epoch)."""
        results = []
        for first in range(start, start + n_micro_batches, self.cfg.grad_accum):
            last = min(first + self.cfg.grad_accum, start + n_micro_batches)
            results.append(self.train_update(list(range(first, last))))
        return results

    @torch.no_grad()
    def evaluate(self, micro_batch: int, seq_len: int, index: int = 0, split: str = "val") -> float:
        self.model.eval()
        try:
            b = to_device(self.batch(index, split, micro_batch, seq_len), self.device)
            with self.autocast():
                loss = self.workload.compute_loss(self.model, b)
            return float("nan") if self.fake else float(loss)
        finally:
            self.model.train()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # --- checkpoints: everything needed to continue exactly, loadable with weights_only=True ---

    def weights(self) -> dict:
        """The model's state dict. Estimates: a quantized layer writes its quant state's numbers (bitsandbytes'
        nested offset via .item()), which fake tensors do not have; they read 1 (sizes do not depend on them)."""
        with _UnknownValuesAreOne() if self.fake else contextlib.nullcontext():
            return self.model.state_dict()

    def state_dict(self) -> dict:
        rng = {"torch": torch.get_rng_state(), "python": list_state(random.getstate())}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": "rentplan-checkpoint/1",
            "model": self.weights(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "rng": rng,
            "update": self.update,
            "position": self.position,
            "window": self.window,
            "grads": ([p.grad for p in self.model.parameters()] if self.window and self.window["done"] else None),
        }

    def save(self, path: str) -> int:
        state = self.state_dict()
        if self.cfg.strategy == "fsdp":  # sharded model and optimizer: each rank writes its shards
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{path}.dcp")
            state.update(model=None, optimizer=None, grads=None)
        if self.rank == 0:  # replicated state: one writer
            tmp = f"{path}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, path)  # a crash mid-save never leaves a half-written checkpoint under the name
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
        return os.path.getsize(path) + _dir_size(f"{path}.dcp")

    def export(self, path: str) -> int:
        from safetensors.torch import save_file, save_model

        if self.cfg.strategy == "fsdp":
            full = self.gathered_weights()
            if self.rank == 0:
                save_file({k: v.contiguous() for k, v in full.items()}, path)
        elif self.rank == 0:
            from probes.hf import export_adapter

            if not export_adapter(self.model, path):  # LoRA: the adapter alone is what ships
                save_model(getattr(self.model, "module", self.model), path)  # shared tensors handled
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
        return os.path.getsize(path)

    def gathered_weights(self) -> dict:
        """FSDP: the full weights, all-gathered shard by shard; rank 0 keeps them (on CPU), the others drop them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, path: str) -> None:
        state = safe_load(path, self.device)
        if self.cfg.strategy == "fsdp":
            self.load_sharded(f"{path}.dcp")
            state = {**state, "model": None, "optimizer": None}
        self.load_state_dict(state)

    def load_sharded(self, checkpoint_id: str | None) -> None:
        """FSDP: each rank reads its own shards in place (DCP). None (estimates): the same calls, nothing read."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        if checkpoint_id is not None:
            import torch.distributed.checkpoint as dcp

            dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=checkpoint_id)
        set_state_dict(self.model, self.optimizer, model_state_dict=msd, optim_state_dict=osd)

    def load_state_dict(self, state: dict) -> None:
        required = ["model", "optimizer", "scheduler", "rng", "update", "position"]
        missing = [k for k in required if k not in state]
        if self.scaler is not None and not state.get("scaler"):
            missing.append("scaler")
        if "rng" in state and "torch" not in state["rng"]:
            missing.append("rng.torch")
        if missing:
            raise ResumeError(f"checkpoint cannot restore the exact state: missing {', '.join(missing)}")
        if state["model"] is not None:  # None: restored from sharded files already
            # An estimate of a quantized base: its layers hold plain fake weights (probes/quantize.py), which take
            # the checkpoint's values but not bitsandbytes' quant-state keys; the memory of the load is the same.
            quantized = getattr(self.workload, "quantize", None)
            model_state = state["model"]
            if quantized and not self.fake:
                from probes.quantize import restore_quant_states

                model_state = restore_quant_states(self.model, model_state, self.device)
            elif quantized:  # its value is unknown under fake tensors; bitsandbytes reads the default ("row")
                model_state = {k: v for k, v in model_state.items() if not k.endswith(".weight_format")}
            self.model.load_state_dict(model_state, strict=not (quantized and self.fake))
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if not self.fake:  # a fake RNG state has no values to restore
            torch.set_rng_state(state["rng"]["torch"].cpu())
        random.setstate(tuple_state(state["rng"]["python"]))
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        self.update = int(state["update"])
        self.position = int(state["position"])
        self.window, self._batches = state.get("window"), None
        if self.window and self.window["done"]:
            grads = state.get("grads")
            if grads is None:
                raise ResumeError("checkpoint is inside an accumulation window but holds no partial gradients")
            for p, g in zip(self.model.parameters(), grads):
                p.grad = None if g is None else g.to(self.device)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers is moved to the meta device at once (only its shape is kept), as
    accelerate's init_empty_weights does; buffers and every other tensor stay real CPU tensors."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), **{**p.__dict__, "requires_grad": p.requires_grad})

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


class _UnknownValuesAreOne(TorchDispatchMode):
    """Estimates: an optimizer that reads a value the fake tensors do not have (Adafactor's parameter norm for
    its relative step size) reads 1. What it allocates does not depend on that number."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor

            t = args[0]
            one = True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            if type(t) is FakeTensor and t.item_memo is None and t.fake_mode.shape_env is None:
                # FakeTensorMode's own answers, without its dispatch (a fifth of an AdamW step: optimizer.py's
                # _get_value reads every parameter's step twice): a kept constant's value (the step counts),
                # else the refusal of fake_impls.local_scalar_dense, read as 1.
                return t.constant.item() if t.constant is not None else one
            try:
                return func(*args, **(kwargs or {}))
            except DataDependentOutputException:
                return one
        return func(*args, **(kwargs or {}))


class _MetaValuesAreZero(TorchDispatchMode):
    """While building for an estimate, reading a parameter's value (.item(), bool(), a branch on it) gives 0:
    parameters are on meta and have none. Sizes do not depend on such values; other tensors stay real."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        return func(*args, **(kwargs or {}))


def make_optimizer(name: str, params: list, lr: float, fake: bool = False) -> torch.optim.Optimizer:
    """The optimizers rentplan sizes. AdamW and SGD as torch runs them on CUDA by default (foreach: one launch
    per group of tensors, with list-sized temporaries); 8-bit AdamW from bitsandbytes (two uint8 moments with
    a float32 absmax per block of 256); Adafactor from torch (a factored second moment: a row and a column
    vector per matrix)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)
    if name == "adamw_fused":  # one kernel per group of tensors, without foreach's list-sized temporaries
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    if name == "adafactor":
        if not hasattr(torch.optim, "Adafactor"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Adafactor (torch >= 2.5 has it)")
        return torch.optim.Adafactor(params, lr=lr, foreach=True)
    if name in ("adamw8bit", "paged_adamw8bit"):
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise RuntimeError(f"optimizer {name} needs bitsandbytes: pip install 'rentplan[quant]'") from None
        cls = bnb.optim.PagedAdamW8bit if name == "paged_adamw8bit" else bnb.optim.AdamW8bit
        if not fake:
            return cls(params, lr=lr, weight_decay=0.0)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # its quantization map (2 × 256 floats) is built from Python numbers
            return cls(params, lr=lr, weight_decay=0.0)
    raise ValueError(f"unknown optimizer {name!r}")


def remake_tensors(model: torch.nn.Module, skip=lambda t: False, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Estimates: every parameter and buffer (but those `skip` names) becomes a fresh tensor under the active
    modes (a fake tensor the tracker counts), floating ones in `dtype` when given. Tied parameters stay tied:
    one new tensor per distinct tensor."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or skip(t):
                    continue
                if id(t) not in made:
                    as_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    new = torch.empty_like(t, device="cpu", dtype=as_dtype)
                    made[id(t)] = (torch.nn.Parameter(new, requires_grad=t.requires_grad)
                                   if isinstance(t, torch.nn.Parameter) else new)
                table[name] = made[id(t)]
    return model


def remake_real_tensors(model: torch.nn.Module) -> torch.nn.Module:
    """Estimates: parameters and buffers made outside the fake mode (peft's adapter) become fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    return remake_tensors(model, skip=lambda t: isinstance(t, FakeTensor) or t.device.type == "meta")


def build_without_weights(workload, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Estimates: build the model's structure for real, with every mode of the pilot set aside, so that
    construction code may read tensor values (timm's drop-path rates via .item(), tolist(), branches on
    values); parameters never take memory (meta). Then parameters and buffers become fresh tensors under
    the active modes (fake tensors, counted by the tracker as setup's allocations). Tied parameters stay
    tied: one new tensor per distinct parameter."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.device("cpu"), _parameters_on_meta(), _MetaValuesAreZero():
        model = workload.build_model()
    keep = workload.weights_left_on_meta(model) if hasattr(workload, "weights_left_on_meta") else set()
    remake_tensors(model, skip=lambda t: id(t) in keep, dtype=dtype)
    return model


def wrap_for_strategy(model: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """DDP (gradients as views into the all-reduce buckets: no second copy), or FSDP2 fully_shard on each
    element of the model's largest ModuleList (its blocks) and then the root."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)
    if strategy == "fsdp":
        import torch.distributed as dist
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with unset_fake_temporarily():  # the mesh reads its rank table: real tensors even under estimates
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        if lists:
            for block in max(lists, key=len):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"unknown strategy {strategy!r}: single, ddp or fsdp")


def list_state(state):
    """random.getstate() as nested lists (plain types only, so weights_only loads it without allowlists)."""
    return [list_state(s) if isinstance(s, tuple) else s for s in state]


def tuple_state(state):
    return tuple(tuple_state(s) if isinstance(s, list) else s for s in state)


def _dir_size(path: str) -> int:
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def safe_load(path: str, device: torch.device | str = "cpu") -> dict:
    """Load a checkpoint without ever unpickling code: refuse any global outside torch's weights-only set
    first (this check does not depend on TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD), then load with weights_only=True."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        unsafe = get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001  not a torch zip checkpoint at all
        raise ResumeError(f"{path} is not a torch checkpoint this tool can read safely ({e})") from None
    if unsafe:
        raise ResumeError(f"refusing {path}: it references globals outside plain tensors and containers "
                          f"({', '.join(sorted(unsafe))}); loading it could run code")
    return torch.load(path, map_location=device, weights_only=True)
