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
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.records import ProbeConfig

WARMUP_UPDATES = 10
CLIP_NORM = 1.0
SCALE_FLOOR = 1.0 / 2**14  # a loss scale driven this low means fp16 is overflowing on every step
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # everything kept in this dtype


def memory_format(workload) -> str:
    """The workload's optional memory_format (checked where it loads, probes/workloads.MEMORY_FORMATS)."""
    return getattr(workload, "memory_format", "contiguous")


def count_targets(workload, batch: dict) -> int:
    """Targets that count in the loss (the contract's optional count_targets); else the micro-batch size."""
    if hasattr(workload, "count_targets"):
        return int(workload.count_targets(batch))
    first = next(iter(batch.values()))
    return int(first.shape[0])


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


@dataclass
class Evaluation:
    loss_sum: float  # over the batches
    batches: int
    right: int = 0  # predictions equal to their targets, of total
    total: int = 0
    kept: list[tuple] = field(default_factory=list)  # (batch, position, prediction, target), the first asked

    @property
    def loss(self) -> float:
        return self.loss_sum / self.batches


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
        self.channels_last = memory_format(workload) == "channels_last"
        if self.channels_last:  # the workload's stated layout: 4-D weights (and inputs, in batch) in NHWC
            self.model.to(memory_format=torch.channels_last)
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
            if self.channels_last:  # images in NHWC, as the model's weights (to_device keeps the strides)
                batch = {k: (v.contiguous(memory_format=torch.channels_last)
                             if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() == 4 else v)
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

    def skip_update(self) -> UpdateResult:
        """Estimates: close the open window as finish_window does, without running its update (its memory was
        counted by replaying an identical update's record: probes/pilot.py, Pilot.replayed_update). Values do not
        exist under fake tensors, so only the counters move (the scheduler's learning rate does not: nothing after an
        estimate's last update reads it); the gradients stay None as zero_grad leaves them."""
        w = self.window
        if not self.fake or self.cfg.strategy == "ddp" or any(p.grad is not None for p in self.model.parameters()):
            raise RuntimeError("skip_update is for estimates whose update leaves no gradient behind")
        self.update += 1
        self.position = w["indices"][-1] + 1
        self.window, self._batches = None, None
        return UpdateResult(float("nan"), sum(w["counts"]), len(w["indices"]))

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
    def evaluate(self, micro_batch: int, seq_len: int, batches: int = 1, split: str = "val",
                 predictions: int | None = None, amp: bool = True) -> Evaluation:
        """The one evaluation of pilots, campaigns and their checks: `batches` micro-batches of `split` in eval
        mode (train mode after). With predictions (a count), the workload's predict() also runs where it has one:
        accuracy, and the first `predictions` (batch, position, prediction, target). Under fake tensors no value
        exists: the loss is NaN and nothing is predicted."""
        out = Evaluation(0.0, batches)
        self.model.eval()
        try:
            for i in range(batches):
                b = to_device(self.batch(i, split, micro_batch, seq_len), self.device)
                with self.autocast() if amp else contextlib.nullcontext():
                    loss = self.workload.compute_loss(self.model, b)
                    out.loss_sum += float("nan") if self.fake else float(loss)
                    if predictions is None or self.fake or not hasattr(self.workload, "predict"):
                        continue
                    pred, target = self.workload.predict(self.model, b)
                    out.right += int((pred == target).sum())
                    out.total += int(target.numel())
                    pairs = zip(pred.reshape(-1).tolist(), target.reshape(-1).tolist())
                    out.kept += [(i, k, p, t) for k, (p, t) in zip(range(predictions - len(out.kept)), pairs)]
        finally:
            self.model.train()
        return out

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

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
        if func is torch.ops.aten._local_scalar_dense.default or func is torch.ops.aten.item.default:
            from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor

            t = args[0]
            one = True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
            if type(t) is FakeTensor and t.item_memo is None and t.fake_mode.shape_env is None:
                # FakeTensorMode's own answers, without its dispatch (a fifth of an AdamW step: optimizer.py's
                # _get_value reads every parameter's step twice): a kept constant's value (the step counts),
                # else the refusal of fake_impls.local_scalar_dense, read as 1. The constant is a real tensor:
                # read with the modes below set aside, or its own .item() goes through all of them.
                if t.constant is None:
                    return one
                with torch._C._DisableTorchDispatch():
                    return t.constant.item()
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


def _adamw(params: list, lr: float, fake: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)


def _adamw_fused(params: list, lr: float, fake: bool) -> torch.optim.Optimizer:
    # one kernel per group of tensors, without foreach's list-sized temporaries
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)


def _sgd(params: list, lr: float, fake: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, foreach=True)


def _adafactor(params: list, lr: float, fake: bool) -> torch.optim.Optimizer:
    if not hasattr(torch.optim, "Adafactor"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Adafactor (torch >= 2.5 has it)")
    return torch.optim.Adafactor(params, lr=lr, foreach=True)


def _eight_bit(name: str):
    def build(params: list, lr: float, fake: bool) -> torch.optim.Optimizer:
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

    return build


# One builder per name of planner/optimizers.py's table (a test checks the keys are its names).
OPTIMIZER_BUILDERS = {"adamw": _adamw, "adamw_fused": _adamw_fused, "sgd": _sgd, "adamw8bit": _eight_bit("adamw8bit"),
                      "paged_adamw8bit": _eight_bit("paged_adamw8bit"), "adafactor": _adafactor}


def make_optimizer(name: str, params: list, lr: float, fake: bool = False) -> torch.optim.Optimizer:
    """The optimizers rentplan sizes. AdamW and SGD as torch runs them on CUDA by default (foreach: one launch
    per group of tensors, with list-sized temporaries); 8-bit AdamW from bitsandbytes (two uint8 moments with
    a float32 absmax per block of 256); Adafactor from torch (a factored second moment: a row and a column
    vector per matrix)."""
    if name not in OPTIMIZER_BUILDERS:
        raise ValueError(f"unknown optimizer {name!r}")
    return OPTIMIZER_BUILDERS[name](params, lr, fake)


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
                    # the meta tensor's shape and strides, not the tensor (a fake made from it costs a conversion)
                    new = torch.empty_strided(t.shape, t.stride(), dtype=as_dtype, device="cpu")
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
