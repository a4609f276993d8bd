"""A Trainer's checkpoints and exports: everything needed to continue exactly, in a file torch.load reads with
weights_only=True (plus DCP shards under FSDP), and the weights to ship as safetensors."""

from __future__ import annotations

import contextlib
import os
import random

import torch

from probes.loop import ResumeError, _UnknownValuesAreOne


def weights(trainer) -> dict:
    """The model's state dict. Estimates: a quantized layer writes its quant state's numbers (bitsandbytes'
    nested offset via .item()), which fake tensors do not have; they read 1 (sizes do not depend on them)."""
    with _UnknownValuesAreOne() if trainer.fake else contextlib.nullcontext():
        return trainer.model.state_dict()


def adapter_weights(trainer) -> dict | None:
    """The LoRA adapter's tensors where the model has one (what export ships), else None."""
    from probes.hf import adapter_weights as of_model

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


def training_state(trainer) -> dict:
    rng = rng_state(trainer)
    return {
        "format": "rentplan-checkpoint/1",
        "model": weights(trainer),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "rng": rng,
        "update": trainer.update,
        "position": trainer.position,
        "window": trainer.window,
        "grads": ([p.grad for p in trainer.model.parameters()] if trainer.window and trainer.window["done"] else None),
    }


def save(trainer, path: str) -> int:
    state = training_state(trainer)
    if trainer.cfg.strategy == "fsdp":  # sharded model and optimizer: each rank writes its shards
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(trainer.model, trainer.optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{path}.dcp")
        state.update(model=None, optimizer=None, grads=None)
    if trainer.rank == 0:  # replicated state: one writer
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)  # a crash mid-save never leaves a half-written checkpoint under the name
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

    from probes.hf import export_adapter

    tmp = f"{path}.tmp-{os.getpid()}"
    if trainer.cfg.strategy == "fsdp":
        full = gathered_weights(trainer)  # every process gives its shards
        if trainer.rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, tmp)
    elif trainer.rank == 0:
        model = getattr(trainer.model, "module", trainer.model)  # DDP wraps the model
        if not (adapter and export_adapter(model, tmp)):
            save_model(model, tmp)
    if trainer.rank == 0:
        os.replace(tmp, path)
    if trainer.world > 1:
        import torch.distributed as dist

        dist.barrier()
    return os.path.getsize(path) if os.path.exists(path) else None


def gathered_weights(trainer) -> dict:
    """FSDP: the full weights, all-gathered shard by shard; rank 0 keeps them (on CPU), the others drop them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load(trainer, path: str) -> None:
    state = safe_load(path, trainer.device)
    if trainer.cfg.strategy == "fsdp":
        load_sharded(trainer, f"{path}.dcp")
        state = {**state, "model": None, "optimizer": None}
    restore(trainer, state)


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
    if state["model"] is not None:  # None: restored from sharded files already
        # An estimate of a quantized base: its layers hold plain fake weights (probes/quantize.py), which take
        # the checkpoint's values but not bitsandbytes' quant-state keys; the memory of the load is the same.
        quantized = getattr(trainer.workload, "quantize", None)
        model_state = state["model"]
        if quantized and not trainer.fake:
            from probes.quantize import restore_quant_states

            model_state = restore_quant_states(trainer.model, model_state, trainer.device)
        elif quantized:  # its value is unknown under fake tensors; bitsandbytes reads the default ("row")
            model_state = {k: v for k, v in model_state.items() if not k.endswith(".weight_format")}
        trainer.model.load_state_dict(model_state, strict=not (quantized and trainer.fake))
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
    return torch.load(path, map_location=device, weights_only=True)
