"""Callbacks for the trainers people already have: ledger lines per phase, as their run goes.

    from probes.callbacks import HFTrainerCallback
    trainer = Trainer(model, args, ..., callbacks=[HFTrainerCallback("rentplan.db", workload="trainer:my-llama")])

    from probes.callbacks import LightningCallback
    L.Trainer(..., callbacks=[LightningCallback("rentplan.db", workload="lightning:my-llama")])

Nothing in the loop changes. Phases are marked by the trainer's own events (probes/observe.py says what each
phase holds); where a trainer has no event for a boundary (Hugging Face has none for an exception, nor around
evaluate, checkpoint saving or save_model), the callback wraps that one method of that one trainer object,
measures around it and calls it unchanged. An out-of-memory error in their loop is written as an `oom` line,
then raised again. `plan` uses these lines like a probe's (the campaign's `workload:` names the same workload).
"""

from __future__ import annotations

import functools
import inspect
import os

from planner.records import canonical_precision
from probes.observe import DEFAULT_STEADY_UPDATES, PhaseRecorder, batch_shape, folder_bytes, optimizer_name

try:  # the base classes only matter where those libraries are installed
    from transformers import TrainerCallback as _HFBase
except ImportError:  # pragma: no cover - exercised where transformers is absent
    _HFBase = object
try:
    from lightning.pytorch.callbacks import Callback as _LBase
except ImportError:  # pragma: no cover
    try:
        from pytorch_lightning.callbacks import Callback as _LBase
    except ImportError:
        _LBase = object

HF_PRECISION = {(False, False): "fp32", (True, False): "bf16", (False, True): "fp16"}


def _wrap(obj, name: str, around) -> None:
    """Replace obj.name (a bound method) by around(original, *args, **kwargs) on this one object."""
    original = getattr(obj, name)
    if getattr(original, "_rentplan", False):
        return

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return around(original, *args, **kwargs)

    wrapped._rentplan = True
    setattr(obj, name, wrapped)


def _shape_hook(recorder: PhaseRecorder):
    def hook(module, args, kwargs):
        recorder.saw_call(module.training, batch_shape(args, kwargs))
    return hook


def _find_caller(kind: type):
    """The trainer object whose method raised this callback event (HF passes callbacks no trainer)."""
    frame = inspect.currentframe()
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, kind):
            return candidate
        frame = frame.f_back
    return None


class HFTrainerCallback(_HFBase):
    """A Hugging Face `transformers.Trainer` callback writing rentplan ledger lines.

    Example: Trainer(..., callbacks=[HFTrainerCallback("rentplan.db", workload="trainer:tiny-gpt2")])"""

    def __init__(self, ledger: str = "rentplan.db", workload: str | None = None, params: dict | None = None,
                 steady_updates: int = DEFAULT_STEADY_UPDATES, eval_seq_len: int | None = None,
                 cap_bytes: int | None = None, census: bool = True):
        self.recorder = PhaseRecorder(ledger, workload, params, "hf-trainer", steady_updates, census,
                                      eval_seq_len, cap_bytes, f"{cap_bytes} B" if cap_bytes else "")
        self._loss = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        from transformers import Trainer

        rec = self.recorder
        trainer = _find_caller(Trainer)
        if rec.workload is None:
            name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
            rec.workload = "trainer:" + str(name).replace("/", "--")
        if rec.eval_seq_len is None and trainer is not None:
            rec.eval_seq_len = longest_example(trainer.eval_dataset)
        model.register_forward_pre_hook(_shape_hook(rec), with_kwargs=True)
        rec.begin(model, args.device, planned_updates=state.max_steps or None,
                  micro_batch=args.per_device_train_batch_size, eval_micro_batch=args.per_device_eval_batch_size,
                  grad_accum=args.gradient_accumulation_steps,
                  precision=HF_PRECISION[(bool(args.bf16), bool(args.fp16))],
                  checkpointing=bool(args.gradient_checkpointing or getattr(model, "is_gradient_checkpointing", False)),
                  optimizer=optimizer_name(optimizer) if optimizer is not None else str(args.optim),
                  lr=float(args.learning_rate),
                  world_size=int(args.world_size), strategy=_hf_strategy(args))
        if trainer is not None:
            self._guard(trainer)

    def _guard(self, trainer) -> None:
        rec = self.recorder

        def failing(original, *a, **kw):
            try:
                return original(*a, **kw)
            except BaseException as e:
                rec.fail(e)
                raise

        def training_step(original, *a, **kw):
            loss = failing(original, *a, **kw)
            # Each micro-batch's loss comes back divided by its share of the window: their sum is the update's.
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
            return loss

        def evaluate(original, *a, **kw):
            rec.phase_begin("eval")
            out = failing(original, *a, **kw)
            loss = out.get("eval_loss") if isinstance(out, dict) else None
            rec.phase_end("eval", **({"loss_last": float(loss)} if loss is not None else {}))
            return out

        def save_checkpoint(original, *a, **kw):
            rec.phase_begin("save")
            out = failing(original, *a, **kw)
            folder = os.path.join(trainer._get_output_dir(trial=None) if hasattr(trainer, "_get_output_dir")
                                  else trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")
            rec.phase_end("save", checkpoint_bytes=_size(folder))
            return out

        def save_model(original, output_dir=None, _internal_call=False, *a, **kw):
            if _internal_call or rec.phase == "save":  # the checkpoint's own weights: part of save
                return failing(original, output_dir, _internal_call, *a, **kw)
            rec.phase_begin("export")
            out = failing(original, output_dir, _internal_call, *a, **kw)
            rec.phase_end("export", checkpoint_bytes=_size(output_dir or trainer.args.output_dir))
            return out

        _wrap(trainer, "training_step", training_step)
        _wrap(trainer, "evaluate", evaluate)
        _wrap(trainer, "_save_checkpoint", save_checkpoint)
        _wrap(trainer, "save_model", save_model)
        if trainer.optimizer is not None:
            _wrap(trainer.optimizer, "step", failing)

    def on_step_begin(self, args, state, control, **kwargs):
        self._loss = None
        self.recorder.update_begin()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            self.recorder.optimizer_state(optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self.recorder.update_end(self._loss)

    def on_train_end(self, args, state, control, **kwargs):
        self.recorder.end()

    def export(self, path: str):
        """`with callback.export("out/"): ...`: an export the callback cannot see otherwise, as a phase."""
        return self.recorder.during("export", path)


def _hf_strategy(args) -> str:
    if int(args.world_size) <= 1:
        return "single"
    return "fsdp" if getattr(args, "fsdp", None) else "ddp"


def _size(path: str | None) -> int | None:
    return folder_bytes(path) if path else None


def longest_example(dataset, limit: int = 100_000) -> int | None:
    """The longest `input_ids` in a dataset of tokenized examples (what eval pads its longest batch to)."""
    if dataset is None:
        return None
    try:
        n = len(dataset)
        if n > limit:
            return None
        column = dataset["input_ids"] if hasattr(dataset, "column_names") else [dataset[i]["input_ids"]
                                                                                for i in range(n)]
        return max(len(x) for x in column) if n else None
    except (TypeError, KeyError, IndexError, AttributeError):
        return None


class LightningCallback(_LBase):
    """A Lightning `Trainer` callback writing rentplan ledger lines.

    Example: L.Trainer(max_steps=50, callbacks=[LightningCallback("rentplan.db", workload="lightning:my-llama")])"""

    def __init__(self, ledger: str = "rentplan.db", workload: str | None = None, params: dict | None = None,
                 steady_updates: int = DEFAULT_STEADY_UPDATES, eval_seq_len: int | None = None,
                 cap_bytes: int | None = None, census: bool = True, checkpointing: bool = False):
        self.recorder = PhaseRecorder(ledger, workload, params, "lightning", steady_updates, census,
                                      eval_seq_len, cap_bytes, f"{cap_bytes} B" if cap_bytes else "")
        self.checkpointing = checkpointing
        self._step0 = None
        self._loss = None

    def on_train_start(self, trainer, pl_module):
        rec = self.recorder
        if rec.workload is None:
            rec.workload = f"lightning:{type(pl_module).__module__}.{type(pl_module).__qualname__}"
        pl_module.register_forward_pre_hook(_shape_hook(rec), with_kwargs=True)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
        rec.begin(pl_module, pl_module.device,
                  planned_updates=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None,
                  grad_accum=int(trainer.accumulate_grad_batches),
                  precision=canonical_precision(str(trainer.precision)),
                  checkpointing=self.checkpointing, optimizer=optimizer_name(optimizer) if optimizer else "none",
                  lr=float(lr), world_size=int(trainer.world_size),
                  strategy="single" if trainer.world_size <= 1 else type(trainer.strategy).__name__.lower()
                  .replace("strategy", ""))

        def save_checkpoint(original, filepath, *a, **kw):
            rec.phase_begin("save")
            out = original(filepath, *a, **kw)  # an exception here reaches on_exception
            rec.phase_end("save", checkpoint_bytes=_size(str(filepath)))
            return out

        _wrap(trainer, "save_checkpoint", save_checkpoint)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % int(trainer.accumulate_grad_batches) == 0:
            self._step0, self._loss = trainer.global_step, None
            self.recorder.update_begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # outputs["loss"] is divided by accumulate_grad_batches: the window's sum is the update's mean loss.
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if hasattr(loss, "detach"):
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        if self._step0 is not None and trainer.global_step > self._step0:
            if trainer.optimizers:
                self.recorder.optimizer_state(trainer.optimizers[0])
            self._step0 = None
            self.recorder.update_end(self._loss)

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.recorder.phase_begin("eval")

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.recorder.phase_end("eval")

    def on_exception(self, trainer, pl_module, exception):
        self.recorder.fail(exception)

    def on_train_end(self, trainer, pl_module):
        self.recorder.end()

    def export(self, path: str):
        """`with callback.export("model.safetensors"): ...`: an export, measured as a phase."""
        return self.recorder.during("export", path)
