"""Data-parallel and sharded pilots: N ranks started by torch.distributed's elastic launcher.

The launcher runs inside a runner worker (its own process group, so a timeout kills every rank). Each
rank appends its lines to its own file (flushed and fsynced per line); the parent commits them to the
ledger as they come and writes the lines of ranks that failed, hung or were stopped by the launcher.
Apart from probes/distributed.py (the collectives) because a rank runs a pilot, whose checkpoints use them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from datetime import timedelta

from planner.records import ProbeConfig
from probes.distributed import COLLECTIVE_TIMEOUT_S


def rank_file(workdir: str, run_id: str, rank: int, first_phase: str) -> str:
    """One file per rank and per launch (training phases, then resume)."""
    return os.path.join(workdir, f"{run_id}.{first_phase}.rank{rank}.jsonl")


def rank_main(phases, cfg_dict: dict, workdir: str, run_id: str, probe_id: str) -> None:
    """The launcher's entrypoint: one pilot rank."""
    import torch
    import torch.distributed as dist

    from probes.pilot import Pilot

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cfg = ProbeConfig(**cfg_dict)
    cuda = cfg.device.startswith("cuda")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    with open(rank_file(workdir, run_id, rank, phases[0]), "a") as f:
        def emit(kind, payload):
            f.write(json.dumps([kind, payload]) + "\n")
            f.flush()
            os.fsync(f.fileno())

        try:  # a rank that cannot start (no driver, a GPU it cannot set, NCCL) says why on its own line
            import probes.warm  # noqa: F401  a spawned rank pays torch's one-time costs here, not inside a phase
            if cuda:
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except BaseException as e:
            from probes.pilot import last_line

            emit("fatal", f"rank {rank} could not start: {last_line(e)}")
            raise
        ok = Pilot(dataclasses.replace(cfg, device=str(device)), workdir, emit, run_id, probe_id, rank=rank).run(phases)
    if ok:
        dist.destroy_process_group()
    else:
        sys.exit(1)  # the launcher then stops the other ranks, instead of leaving them inside a collective


def launch(phases, cfg_dict: dict, workdir: str, run_id: str, probe_id: str) -> None:
    """Start world_size ranks on this node and wait for them (runs in a runner worker).

    Under a CUDA (or ROCm) build ranks are spawned, never forked: LaunchConfig.__post_init__ asks
    torch.accelerator.is_available() (for NUMA binding, torch/distributed/launcher/api.py), which in such a build
    poisons every later fork of this process (torch/csrc/cuda/Module.cpp, poison_fork), so a forked rank could not
    use its GPU. torchrun spawns too."""
    import torch
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    n = int(cfg_dict["world_size"])
    # torch.backends.cuda.is_built() reads a build flag (it asks the driver nothing): a CPU-only build has no CUDA
    # to poison, and its forked ranks start warm from the runner's worker, as before.
    start = "spawn" if torch.backends.cuda.is_built() else "fork"
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=run_id, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1, start_method=start)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    elastic_launch(config, rank_main)(phases, cfg_dict, workdir, run_id, probe_id)
