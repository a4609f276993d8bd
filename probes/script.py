"""`rentplan probe --script train.py -- ARGS`: a plain PyTorch script, run as it is, phase lines from hooks.

The script runs in a worker process (probes/runner.call_in_worker) as `__main__`, with these hooks around it
(each calls the original unchanged):
- `nn.Module.__call__`: the first call of a module with parameters, in training mode and outside any other
  module's call, names the model; the recorder starts there (setup ends). Its calls give the batch shape, the
  precision (autocast's dtype, else the parameters' dtype) and the accumulation (calls per optimizer step).
- optimizer steps (torch's global step hook): an update ends; `Tensor.backward` gives the loss.
- `model.eval()` / `model.train()` on that model: eval begins / ends.
- `torch.save`: save; `safetensors.torch.save_file` / `save_model`: export.
- `torch.utils.checkpoint.checkpoint`: the run uses activation checkpointing.
A callback in the script (probes.callbacks) is the other way to mark phases; the two are not combined.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys

import torch

from planner.records import OBSERVED_PHASES, Line, ProbeConfig
from probes.observe import DEFAULT_STEADY_UPDATES, PhaseRecorder, batch_shape, folder_bytes, optimizer_name

PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class ScriptHooks:
    def __init__(self, recorder: PhaseRecorder):
        self.rec = recorder
        self.model: torch.nn.Module | None = None
        self.depth = 0
        self.calls_in_update = 0
        self.loss = None
        self.in_update = False

    # --- events ---

    def module_call(self, module, args, kwargs) -> None:
        if self.model is None:
            if not module.training or next(module.parameters(), None) is None:
                return
            self.start(module)
        if module is not self.model:
            return
        self.rec.saw_call(module.training, batch_shape(args, kwargs))
        if module.training and self.rec.phase not in ("eval", "save", "export"):
            if not self.in_update:
                self.in_update, self.loss = True, None
                self.rec.update_begin()
            self.calls_in_update += 1

    def start(self, model: torch.nn.Module) -> None:
        self.model = model
        param = next(model.parameters())
        kind = param.device.type
        if torch.is_autocast_enabled(kind):
            precision = PRECISION.get(torch.get_autocast_dtype(kind), "fp32")
        else:
            precision = {torch.float32: "fp32", torch.bfloat16: "bf16-true", torch.float16: "16-true"}.get(
                param.dtype, str(param.dtype).replace("torch.", ""))
        self.rec.begin(model, param.device, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                       precision=precision, checkpointing=False, optimizer="unknown")

    def backward(self, tensor) -> None:
        if self.in_update and tensor.dim() == 0:
            self.loss = tensor.detach() if self.loss is None else self.loss + tensor.detach()

    def step(self, optimizer) -> None:
        if not self.in_update:
            return
        if self.rec.updates == 0:
            self.rec.config["grad_accum"] = self.calls_in_update
            self.rec.config["lr"] = float(optimizer.param_groups[0]["lr"])
            self.rec.optimizer_state(optimizer)
            self.rec.config["optimizer"] = optimizer_name(optimizer)
        self.in_update, self.calls_in_update = False, 0
        # fp16 with a GradScaler backpropagates a scaled loss: overflow there is normal, not divergence
        fp16 = self.rec.config.get("precision") == "fp16"
        self.rec.update_end(None if fp16 else self.loss)

    def mode(self, module, training: bool) -> None:
        if module is not self.model or self.model is None:
            return
        if not training:
            self.in_update = False
            self.rec.phase_begin("eval")
        else:
            self.rec.phase_end("eval")

    def checkpointing(self) -> None:
        if self.rec.cfg is None:
            self.rec.config["checkpointing"] = True

    @contextlib.contextmanager
    def saving(self, phase: str, path):
        self.in_update = False  # the next training call of the model begins an update
        self.rec.phase_begin(phase)
        yield
        self.rec.phase_end(phase, **({"checkpoint_bytes": folder_bytes(str(path))}
                                     if isinstance(path, (str, os.PathLike)) else {}))

    # --- installing ---

    @contextlib.contextmanager
    def installed(self):
        nn = torch.nn.Module
        original_call, original_train, original_save = nn.__call__, nn.train, torch.save
        hooks = self

        def call(module, *args, **kwargs):
            if hooks.depth == 0:
                hooks.module_call(module, args, kwargs)
            hooks.depth += 1
            try:
                return original_call(module, *args, **kwargs)
            finally:
                hooks.depth -= 1

        def train(module, mode: bool = True):
            hooks.mode(module, mode)
            return original_train(module, mode)

        def save(obj, f, *a, **kw):
            if hooks.rec.phase in ("save", "export"):
                return original_save(obj, f, *a, **kw)
            with hooks.saving("save", f):
                return original_save(obj, f, *a, **kw)

        original_backward = torch.Tensor.backward

        def backward(tensor, *a, **kw):
            hooks.backward(tensor)
            return original_backward(tensor, *a, **kw)

        import torch.utils.checkpoint as ckpt

        original_checkpoint = ckpt.checkpoint

        def checkpoint(*a, **kw):
            hooks.checkpointing()
            return original_checkpoint(*a, **kw)

        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(lambda opt, a, kw: hooks.step(opt))
        patches = [(nn, "__call__", call), (nn, "train", train), (torch, "save", save),
                   (torch.Tensor, "backward", backward), (ckpt, "checkpoint", checkpoint)]
        try:
            import safetensors.torch as st

            for name in ("save_file", "save_model"):
                patches.append((st, name, self._exporting(getattr(st, name))))
        except ImportError:
            pass
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        for obj, name, fn in patches:
            setattr(obj, name, fn)
        try:
            yield self
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)
            handle.remove()

    def _exporting(self, fn):
        hooks = self

        def export(obj, filename, *a, **kw):
            if hooks.rec.phase in ("save", "export"):
                return fn(obj, filename, *a, **kw)
            with hooks.saving("export", filename):
                return fn(obj, filename, *a, **kw)
        return export


def run_script(path: str, argv: list[str], ledger: str, workload: str, run_id: str,
               steady_updates: int = DEFAULT_STEADY_UPDATES, eval_seq_len: int | None = None,
               cap_bytes: int | None = None, cap: str = "") -> dict:
    """Run the script as __main__ under the hooks (in a worker). Returns what was written."""
    rec = PhaseRecorder(ledger, workload, {}, "script", steady_updates, True, eval_seq_len, cap_bytes, cap)
    rec.run_id = run_id
    hooks = ScriptHooks(rec)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with hooks.installed():
            try:
                runpy.run_path(path, run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise RuntimeError(f"the script exited with status {e.code}") from None
            except BaseException as e:
                rec.fail(e)
                raise
    finally:
        rec.end()
    if hooks.model is None:
        raise RuntimeError("the script never called a model with parameters in training mode: nothing to measure")
    return {"phases": sorted(rec.written), "failed": rec.failed, "updates": rec.updates}


def write_verdict_line(ledger: str, lines, run_id: str, workload: str, verdict: str, detail: str) -> None:
    """The worker was killed (timeout) or died: a line for the phase it was in, with the run's configuration.
    Which phase is inferred (the first of setup, first_step, steady, eval without a line), and the detail says so."""
    import dataclasses
    import socket
    from datetime import datetime, timezone

    from planner.ledger import Ledger

    done = set(lines["phase"]) if len(lines) else set()
    phase = next((p for p in OBSERVED_PHASES if p not in done), "export")
    names = {f.name for f in dataclasses.fields(ProbeConfig)}
    if len(lines):
        last = lines.iloc[-1].to_dict()
        cfg = ProbeConfig(**{k: (bool(v) if k == "checkpointing" else v) for k, v in last.items()
                             if k in names and v is not None and v == v})
        where = {k: last.get(k) for k in ("device", "device_name", "device_total_bytes", "torch_version",
                                           "cuda_version", "host")}
        probe_id = last["probe_id"]
    else:
        cfg = ProbeConfig(workload=workload)
        where = {"device": "unknown", "device_name": "unknown", "device_total_bytes": None,
                 "torch_version": torch.__version__, "cuda_version": torch.version.cuda, "host": socket.gethostname()}
        probe_id = "p-script"
    where["device"] = where["device"] or "unknown"
    line = Line.from_config(cfg, run_id=run_id, probe_id=probe_id, phase=phase, verdict=verdict,
                            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), source="script",
                            detail=f"{detail} (in flight: inferred as {phase}, the first phase without a line)",
                            **where)
    with Ledger(ledger) as led:
        led.append(line)


def probe_script(path: str, argv: list[str], ledger_path: str, workload: str, steady: int, eval_seq: int | None,
                 cap_bytes: int | None, cap_label: str, timeout_s: float, progress=print):
    """`rentplan probe --script`: the script in a worker under the hooks; returns (run id, the run's lines, the
    error or None). A worker that timed out or died gets the line of the phase it was in, written here."""
    from planner.ledger import new_id, read_lines
    from probes.runner import WorkerLost, call_in_worker

    run_id = new_id("r")
    progress(f"probe --script {path}: run {run_id} as {workload}; ledger {ledger_path}")
    error, lost = None, None
    try:
        call_in_worker(run_script, (path, argv, ledger_path, workload, run_id, steady, eval_seq, cap_bytes,
                                    cap_label), timeout_s)
    except WorkerLost as e:  # nothing in the worker could write the phase it was in
        error, lost = str(e), e
    except RuntimeError as e:  # the worker wrote the failing phase's line itself
        error = str(e)
    mine = read_lines(ledger_path).query("run_id == @run_id")
    if lost is not None:
        write_verdict_line(ledger_path, mine, run_id, workload, lost.verdict, error)
        mine = read_lines(ledger_path).query("run_id == @run_id")
    return run_id, mine, error
