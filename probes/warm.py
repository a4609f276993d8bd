"""Imported once by the forkserver: pays torch's lazy one-time costs (the first optimizer imports
torch._dynamo, about a second) so that every forked worker starts warm."""

import gc

import torch
import torch._dynamo  # noqa: F401  imported by the first torch.optim optimizer otherwise
import torch.utils.flop_counter  # noqa: F401
from safetensors.torch import save_model  # noqa: F401

import probes.builtin  # noqa: F401
import probes.pilot  # noqa: F401
import probes.runner  # noqa: F401  the workers' entry point (and pandas, via the ledger)


def _warm() -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.zeros(2, 4)).sum().backward()
    opt.step()


def _warm_estimates() -> None:
    """One tiny estimate: fake tensors, the GPU kernels' emulation, the census and the allocator model all
    import and register their parts here, once, rather than in every estimate's worker."""
    import json
    import tempfile

    from planner.records import PHASES, ProbeConfig

    cfg = ProbeConfig(params_json=json.dumps({"layers": 1, "d_model": 16, "heads": 2, "vocab": 32, "dropout": 0.1}),
                      micro_batch=1, seq_len=8, eval_seq_len=8, precision="bf16", mode="estimated", target="sm80+")
    with tempfile.TemporaryDirectory() as tmp:
        probes.pilot.Pilot(cfg, tmp, lambda kind, payload: None, "r-warm", "p-warm").run(PHASES)


# Everything imported lives as long as the process: keep it out of the collector's scans, so the gc.collect()
# at every phase boundary costs milliseconds rather than a fifth of a second (the warm-up's seven included).
gc.collect()
gc.freeze()
_warm()
_warm_estimates()
gc.collect()
gc.freeze()
