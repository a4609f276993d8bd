"""Imported once by the forkserver: pays torch's lazy one-time costs (the first optimizer imports
torch._dynamo, about a second) so that every forked worker starts warm.

The forkserver forks every worker, so it must never ask CUDA anything: in a CUDA (or ROCm) build,
torch.cuda.is_available() calls _cuda_getDeviceCount, whose poison_fork() registers a pthread_atfork
handler that marks every later child "in bad fork" (torch/csrc/cuda/Module.cpp, poison_fork and
THCPModule_getDeviceCount_wrap), and the child's first CUDA call then raises "Cannot re-initialize CUDA in
forked subprocess" (torch/cuda/__init__.py, _lazy_init). An optimizer step asks it
(Optimizer._cuda_graph_capture_health_check) and so does FakeTensorMode (its avoid_device_init property), so
in such a build the server only imports; a CPU-only build has no CUDA to ask and warms up fully."""

import gc

import torch
import torch._dynamo  # noqa: F401  imported by the first torch.optim optimizer otherwise
import torch.utils.flop_counter  # noqa: F401
from safetensors.torch import save_model  # noqa: F401

import probes.builtin  # noqa: F401
import probes.pilot  # noqa: F401
from planner.records import PHASES, ProbeConfig


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

    cfg = ProbeConfig(params_json=json.dumps({"layers": 1, "d_model": 16, "heads": 2, "vocab": 32, "dropout": 0.1}),
                      micro_batch=1, seq_len=8, eval_seq_len=8, precision="bf16", mode="estimated", target="sm80+")
    with tempfile.TemporaryDirectory() as tmp:
        probes.pilot.Pilot(cfg, tmp, lambda kind, payload: None, "r-warm", "p-warm").run(PHASES)


# torch.backends.cuda.is_built() reads a build flag: it asks the driver nothing.
CPU_ONLY_BUILD = not torch.backends.cuda.is_built()

# Everything imported lives as long as the process: keep it out of the collector's scans, so the gc.collect()
# at every phase boundary costs milliseconds rather than a fifth of a second (the warm-up's seven included).
gc.collect()
gc.freeze()
if CPU_ONLY_BUILD:
    _warm()
    _warm_estimates()
else:  # what the estimate's warm-up would import, without entering FakeTensorMode
    import torch._subclasses.fake_tensor  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    import probes.census  # noqa: F401
    import probes.fake  # noqa: F401
gc.collect()
gc.freeze()
