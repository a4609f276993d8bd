"""Process groups and the collectives that pilots and campaigns share: a fake group for estimates, torchrun's
world, sums, broadcasts and gathers across ranks. The launcher that starts a pilot's ranks is probes/ranks.py."""

from __future__ import annotations

import os
from datetime import timedelta

COLLECTIVE_TIMEOUT_S = 120


def init_fake_process_group(world_size: int) -> None:
    """Estimates of one rank of N: torch's fake process group (its collectives return at once and move no
    data; under fake tensors there is no data). Its registration lives in torch.testing._internal."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        raise RuntimeError(f"this torch has no fake process group ({e}); distributed estimates need torch >= 2.2. "
                           "Probe with --nproc on real devices instead.") from None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)



# --- a campaign under torchrun: every rank trains its share of each update; rank 0 writes ---------------------

def torchrun_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 outside torchrun)."""
    text = os.environ.get("WORLD_SIZE", "1")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def init_from_env():
    """Under torchrun: start the process group; return (rank, world size, this rank's device)."""
    import torch
    import torch.distributed as dist

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return rank, world, device


def world_of() -> tuple[int, int]:
    """(rank, world size) of this process: (0, 1) without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def summed(values: list[float], device) -> list[float]:
    """Element-wise sum over ranks (the values themselves without a process group)."""
    import torch
    import torch.distributed as dist

    if world_of()[1] == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def from_rank0(obj):
    """Rank 0's value on every rank (ids, decisions)."""
    import torch.distributed as dist

    if world_of()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def every_rank(obj) -> list:
    """Every rank's value, in rank order, on every rank ([obj] without a process group)."""
    import torch.distributed as dist

    if world_of()[1] == 1:
        return [obj]
    out = [None] * world_of()[1]
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if world_of()[1] > 1:
        dist.barrier()
