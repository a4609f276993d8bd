"""A Trainer's checkpoints and exports: everything needed to continue exactly, in a file torch.load reads with
weights_only=True (plus DCP shards under FSDP), and the weights to ship as safetensors."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import random

import torch

from planner.storage import storage_problem
from probes.hf import adapter_weights as of_model
from probes.hf import export_adapter
from probes.loop import ResumeError, _UnknownValuesAreOne
from probes.memory import device_side, host_side
from probes.quantize import restore_quant_states


def weights(trainer) -> dict:
    """The model's state dict. Estimates: a quantized layer writes its quant state's numbers (bitsandbytes'
    nested offset via .item()), which fake tensors do not have; they read 1 (sizes do not depend on them)."""
    with _UnknownValuesAreOne() if trainer.fake else contextlib.nullcontext():
        return trainer.model.state_dict()


def adapter_weights(trainer) -> dict | None:
    """The LoRA adapter's tensors where the model has one (what export ships), else None."""
    with _UnknownValuesAreOne() if trainer.fake else contextlib.nullcontext():  # peft reads the full state dict
        return of_model(getattr(trainer.model, "module", trainer.model))


def rng_state(trainer) -> dict:
    """This process's generators; with several ranks, every rank's too (under "ranks", gathered to each): each rank
    draws its own dropout masks (seeded per rank or not), so one rank's state restored everywhere is not exact."""
    rng = {"torch": torch.get_rng_state(), "python": list_state(random.getstate())}
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    if trainer.world > 1 and not trainer.fake:  # a fake process group moves nothing: estimates size rank 0's
        from probes.distributed import every_rank

        rng["ranks"] = every_rank(dict(rng))
    return rng


def restore_rng(trainer, rng: dict) -> None:
    """Each rank takes back its own generators (rank 0's where the checkpoint has no per-rank states)."""
    ranks = rng.get("ranks")
    if ranks and len(ranks) == trainer.world:
        rng = ranks[trainer.rank]
    if not trainer.fake:  # a fake RNG state has no values to restore
        torch.set_rng_state(rng["torch"].cpu())
    random.setstate(tuple_state(rng["python"]))
    if "cuda" in rng and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), trainer.device)


FINGERPRINT_SAMPLES = 1024


def frozen_names(model) -> list[str]:
    """The parameters that do not train (a LoRA/QLoRA base, a frozen backbone), under every name they have (a tied
    embedding is also the head's weight: named_parameters lists a shared tensor once unless asked)."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]


def _frozen_entries(model, model_state: dict, frozen: list[str]) -> set[str]:
    """The state-dict entries of the frozen base: its parameters, and the extra state of the modules that own them
    (a quantized layer's absmax, quant maps, SCB, weight_format), which never changes in training. A trained
    parameter (a bias beside a frozen weight: BitFit, peft's bias="lora_only") and every buffer (a frozen
    backbone's batch-norm statistics still move) stay."""
    modules = {name for name, _ in model.named_modules(remove_duplicate=False)}
    kept = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    kept |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    owners = {name.rpartition(".")[0] for name in frozen}

    def owner(key: str) -> str:
        parts = key.split(".")
        return next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in modules), "")

    names = set(frozen)
    return {k for k in model_state if k in names or (k not in kept and owner(k) in owners)}


FINGERPRINT_CHUNK = 1 << 24  # elements summed at a time: at most 128 MiB of float64 beside the weights


def fingerprint(trainer, names: list[str]) -> list[list[float]] | None:
    """Two figures per frozen parameter: the sum of every element (in chunks, float64), which a change anywhere
    moves, and an even sample weighted by position, which a permutation moves. Enough to tell the base a resume
    rebuilt from another (other weights, another seed, rows reordered). None under fake tensors (no values)."""
    if trainer.fake:
        return None
    params = dict(trainer.model.named_parameters(remove_duplicate=False))
    out = []
    with torch.no_grad():
        for n in names:
            flat = params[n].detach().reshape(-1)
            total = sum(float(flat[i:i + FINGERPRINT_CHUNK].double().sum())
                        for i in range(0, flat.numel(), FINGERPRINT_CHUNK))
            sample = flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES].double()
            weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
            out.append([total, float((sample * weights).sum())])
    return out


def trained_weights(trainer) -> tuple[dict, dict | None]:
    """What a checkpoint keeps of the model, and what it leaves out. A full fine-tune keeps everything. A model with
    frozen parameters (LoRA, QLoRA) keeps what trains and the buffers, never the frozen base: resume rebuilds the base
    from its source (build_model) and checks it against the fingerprint kept here, as peft's and Lightning's
    fine-tuning checkpoints hold the adapter alone. A 7B LoRA's checkpoint is then megabytes, not 13 GB."""
    model_state = weights(trainer)
    frozen = frozen_names(trainer.model)
    if not frozen:
        return model_state, None
    left_out = _frozen_entries(trainer.model, model_state, frozen)
    kept = {k: v for k, v in model_state.items() if k not in left_out}
    return kept, {"params": frozen, "keys": sorted(left_out), "fingerprint": fingerprint(trainer, frozen)}


def training_state(trainer) -> dict:
    rng = rng_state(trainer)
    # FSDP: the model goes to DCP shards (save() drops this entry; an estimate sizes it from here), and its sharded
    # parameters are not read whole for a fingerprint
    model_state, frozen = (weights(trainer), None) if trainer.cfg.strategy == "fsdp" else trained_weights(trainer)
    return {
        "format": "rentplan-checkpoint/1",
        "model": model_state,
        "frozen": frozen,
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "rng": rng,
        "update": trainer.update,
        "position": trainer.position,
        "window": trainer.window,
        "grads": ([p.grad for p in trainer.model.parameters()] if trainer.window and trainer.window["done"] else None),
    }


class DiskFull(OSError):
    """A checkpoint or export that the disk could not hold, said as such (torch's writer says only 'enforce fail at
    inline_container.cc: unexpected pos')."""


def written_whole(path: str, write) -> None:
    """`write(tmp)`, then the file moves to `path` in one step: a crash mid-write never leaves a half file under the
    name, and a failed write leaves no temporary file either; a disk that filled is named."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        full = storage_problem(os.path.dirname(path) or ".")  # read before the temporary file frees its space
        with contextlib.suppress(OSError):
            os.remove(tmp)
        no_space = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e)  # safetensors
        if isinstance(e, Exception) and (full or no_space):
            raise DiskFull(errno.ENOSPC, f"{full or 'the disk is full'}: {os.path.basename(path)} could not be "
                           f"written ({written:,} bytes of it were; nothing is left of it). Free space there or "
                           "write elsewhere (--out), then run again.") from None
        raise


def save(trainer, path: str) -> int:
    state = training_state(trainer)
    if trainer.cfg.strategy == "fsdp":  # sharded model and optimizer: each rank writes its shards
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{path}.dcp")
        state.update(model=None, optimizer=None, grads=None)
    if trainer.rank == 0:  # replicated state: one writer
        written_whole(path, lambda tmp: torch.save(state, tmp))
    if trainer.world > 1:
        import torch.distributed as dist

        dist.barrier()
    return os.path.getsize(path) + dir_size(f"{path}.dcp")


def export(trainer, path: str, adapter: bool = True) -> int | None:
    """The weights to ship, as safetensors: the LoRA adapter alone where the model has one (and adapter is
    asked), else the whole model (shared tensors handled); under FSDP the full weights gathered to rank 0. Written
    under a temporary name and moved into place: a kill mid-export leaves no half file. Returns the file's size
    (None on a rank whose machine does not hold it)."""
    from safetensors.torch import save_file, save_model

    if trainer.cfg.strategy == "fsdp":
        full = gathered_weights(trainer)  # every process gives its shards
        if trainer.rank == 0:
            written_whole(path, lambda tmp: save_file({k: v.contiguous() for k, v in full.items()}, tmp))
    elif trainer.rank == 0:
        model = getattr(trainer.model, "module", trainer.model)  # DDP wraps the model

        def write(tmp):
            if not (adapter and export_adapter(model, tmp)):
                save_model(model, tmp)
        written_whole(path, write)
    if trainer.world > 1:
        import torch.distributed as dist

        dist.barrier()
    return os.path.getsize(path) if os.path.exists(path) else None


def gathered_weights(trainer) -> dict:
    """FSDP: the full weights, all-gathered shard by shard; rank 0 keeps them (on CPU), the others drop them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load(trainer, path: str) -> None:
    """Resume from a checkpoint file without two copies of it on the device: the file is read into host memory
    (memory-mapped, as torch.load(mmap=True) reads it), and each tensor is copied onto the device into the model the
    trainer built (load_state_dict copies in place) or the optimizer's state (its load_state_dict casts it to the
    parameters' device). The torch.load(map_location=device) this replaces put the whole file on the GPU first."""
    with host_side():
        state = safe_load(path)
    if trainer.cfg.strategy == "fsdp":
        load_sharded(trainer, f"{path}.dcp")
        state = {**state, "model": None, "optimizer": None}
    restore_from_host(trainer, state)


def restore_from_host(trainer, state: dict) -> None:
    """restore(), from a state read into host memory; what the device then holds of it is counted there (on a CPU
    pilot the device is the host: the optimizer's state and partial gradients become device memory as they are)."""
    restore(trainer, state)
    held = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held += [p.grad for p in trainer.model.parameters() if p.grad is not None]
    device_side(held)


def load_sharded(trainer, checkpoint_id: str | None) -> None:
    """FSDP: each rank reads its own shards in place (DCP). None (estimates): the same calls, nothing read."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    if checkpoint_id is not None:
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=checkpoint_id)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=msd, optim_state_dict=osd)


def restore(trainer, state: dict) -> None:
    required = ["model", "optimizer", "scheduler", "rng", "update", "position"]
    missing = [k for k in required if k not in state]
    if trainer.scaler is not None and not state.get("scaler"):
        missing.append("scaler")
    if "rng" in state and "torch" not in state["rng"]:
        missing.append("rng.torch")
    if missing:
        raise ResumeError(f"checkpoint cannot restore the exact state: missing {', '.join(missing)}")
    frozen = state.get("frozen")
    if state["model"] is not None:  # None: restored from sharded files already
        # An estimate of a quantized base: its layers hold plain fake weights (probes/quantize.py), which take
        # the checkpoint's values but not bitsandbytes' quant-state keys; the memory of the load is the same.
        quantized = getattr(trainer.workload, "quantize", None)
        model_state = state["model"]
        if quantized and not trainer.fake:
            model_state = restore_quant_states(trainer.model, model_state, trainer.device)
        elif quantized:  # its value is unknown under fake tensors; bitsandbytes reads the default ("row")
            model_state = {k: v for k, v in model_state.items() if not k.endswith(".weight_format")}
        if frozen:  # the base is the one build_model made just now: what trains comes from the file
            check_frozen_base(trainer, frozen)
        result = trainer.model.load_state_dict(model_state, strict=not (quantized and trainer.fake) and not frozen)
        if frozen:
            left = set(result.missing_keys) - set(frozen["keys"])
            if left or result.unexpected_keys:
                raise ResumeError(f"checkpoint does not match the model: missing {sorted(left)[:5]}, unexpected "
                                  f"{sorted(result.unexpected_keys)[:5]}")
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    if trainer.scaler is not None:
        trainer.scaler.load_state_dict(state["scaler"])
    restore_rng(trainer, state["rng"])
    trainer.update = int(state["update"])
    trainer.position = int(state["position"])
    trainer.window, trainer._batches = state.get("window"), None
    if trainer.window and trainer.window["done"]:
        grads = state.get("grads")
        if grads is None:
            raise ResumeError("checkpoint is inside an accumulation window but holds no partial gradients")
        for p, g in zip(trainer.model.parameters(), grads):
            p.grad = None if g is None else g.to(trainer.device)


def check_frozen_base(trainer, frozen: dict) -> None:
    """The rebuilt base must be the one the adapter was trained on (the checkpoint does not hold it)."""
    if frozen_names(trainer.model) != frozen["params"]:
        raise ResumeError("the model built for resume freezes other parameters than the checkpoint's run did")
    want, got = frozen.get("fingerprint"), fingerprint(trainer, frozen["params"])
    same = lambda a, b: all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9) for x, y in zip(a, b))  # noqa: E731
    if want is not None and got is not None and not all(same(a, b) for a, b in zip(want, got)):
        bad = next(n for n, a, b in zip(frozen["params"], want, got) if not same(a, b))
        raise ResumeError(f"the frozen base build_model made differs from the one this checkpoint trained on (first at "
                          f"{bad}); the checkpoint holds only what trains, so build_model must make the same base: "
                          "load it from its files, or seed its initialisation")


def list_state(state):
    """random.getstate() as nested lists (plain types only, so weights_only loads it without allowlists)."""
    return [list_state(s) if isinstance(s, tuple) else s for s in state]


def tuple_state(state):
    return tuple(tuple_state(s) if isinstance(s, list) else s for s in state)


def dir_size(path: str) -> int:
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
    return torch.load(path, map_location=device, weights_only=True, mmap=True)
