"""GPU memory a pilot on a CPU (or an estimate) never sees: library workspaces and communication buffers.

The CUDA context is the catalog's `defaults.cuda_context_gib` (sources in REFERENCE.md: ~0.3–0.5 GiB with
lazy module loading). What is added here, per GPU, to lines not measured on a CUDA GPU (a CUDA line's reserved
peak already holds its own GPU's workspaces: a target with larger ones adds the difference):

- cuBLAS workspace, one per (handle, stream), allocated through the caching allocator at the first matmul
  and kept: CUBLAS_WORKSPACE_CONFIG's default ":4096:2:16:8" = 8,519,680 bytes, 32 MiB on sm90 and Blackwell
  (aten/src/ATen/cuda/CublasHandlePool.cpp @ 26a39059: parseChosenWorkspaceSize, setWorkspaceForHandle).
- cuBLASLt workspace: 1 MiB by default (parseCUDABlasLtWorkspaceSize), kept per (handle, stream) the same way.
  Newer torch can let cuBLASLt share the cuBLAS workspace (pytorch/pytorch#168175, #173002, "unified workspace"):
  then the 1 MiB is not there, and the plan errs by 2 MiB on the side of fitting.
- ROCm: hipBLAS 32 MiB (128 MiB on gfx94x/gfx95x, MI300X) and hipBLASLt 76 MiB, same file.
- Two threads hold them in a training step: a handle is per thread (getCurrentCUDABlasHandle reserves it from a
  thread_local PoolWindow), and the backward's matmuls run on the autograd engine's thread for the device
  (torch/csrc/autograd/engine.cpp, Engine::start_device_threads), not on the thread that ran the forward and the
  optimizer. So a training line holds two of each; their reserved bytes come from replaying the four requests
  through the caching allocator's model (two 8.1 MiB cuBLAS requests share one 20 MiB segment; 32 MiB ones take
  32 MiB each; the 1 MiB cuBLASLt ones share a 2 MiB small-pool segment). On the public H100 rows
  (benchmarks/gpu-truth, benchmarks/gpu_truth.py) the estimate's allocated peak read exactly 64.0 MiB under the
  real active peak on all four Llama/gemma rows before these were counted: two 32 MiB workspaces, not one.
- NCCL buffers, for DDP and FSDP only (outside PyTorch's allocator): 1.6 GB per process after an all-reduce
  on one communicator (NVIDIA/nccl#864); 1.06 GB on 8 × H100 after init (NVIDIA/nccl#1685); they grow
  with the channels NCCL opens (maintainer, NVIDIA/nccl#986). The planner takes the high end.
"""

from __future__ import annotations

import json

from planner.models.allocator import replay

MiB = 1 << 20
CUBLAS_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
NCCL_BYTES = int(1.6e9)
# parseChosenWorkspaceSize's 32 MiB: Hopper, and Blackwell since pytorch/pytorch#175344 (2026-02, majors 10 and 12;
# its revert #182669 was closed unmerged) and #189312 (2026-07, Thor's 11). A torch older than those gives Blackwell
# 8 MiB: planning 32 MiB there errs on the side of fitting.
HOPPER_WORKSPACE_MAJORS = ("9", "10", "11", "12")
BLAS_THREADS = 2  # the thread that runs the forward and the optimizer, and the autograd engine's device thread
# DDP's constructor broadcasts rank 0's parameters and buffers (torch/nn/parallel/distributed.py, _sync_module_states)
# through c10d's broadcast_coalesced (torch/csrc/distributed/c10d/comm.cpp): each 250 MiB bucket is flattened into a
# copy, at most 2 in flight (max_in_flight). The backend's worker thread drops a finished broadcast only after it has
# woken the caller (ProcessGroupGloo::runLoop resets workInProgress_ after execute()), so one more copy can still be
# alive when the reducer allocates its gradient buckets: a 2-core CI machine measured 3.0 x the parameters at setup.
DDP_BROADCAST_BYTES = 3 * 250 * MiB


def _workspaces(compute_capability: str | None, software: str, arch: str | None) -> tuple[int, int]:
    """(BLAS, BLASLt) workspace bytes of one (handle, stream)."""
    if software == "rocm":
        return (128 * MiB if (arch or "").lower() in ("cdna3", "cdna4") else 32 * MiB), 76 * MiB
    major = str(compute_capability or "").split(".")[0]
    return (32 * MiB if major in HOPPER_WORKSPACE_MAJORS else CUBLAS_DEFAULT), MiB


def workspace_allocated_bytes(compute_capability: str | None, software: str = "cuda", arch: str | None = None,
                              threads: int = BLAS_THREADS) -> int:
    """Allocated (not reserved) bytes of the BLAS workspaces: what a CUDA line's allocated peak holds after the
    first matmul (of each thread) and an estimate does not."""
    return threads * sum(_workspaces(compute_capability, software, arch))


def workspace_bytes(compute_capability: str | None, software: str = "cuda", arch: str | None = None,
                    threads: int = BLAS_THREADS) -> int:
    """Reserved bytes of the BLAS workspaces of `threads` threads on one stream, as the caching allocator's model
    places them."""
    blas, lt = _workspaces(compute_capability, software, arch)
    events = [("a", f"{kind}{t}", size) for t in range(threads) for kind, size in (("blas", blas), ("lt", lt))]
    return int(replay(events)[""]["peak_reserved"])


def describe(compute_capability: str | None, software: str = "cuda", arch: str | None = None) -> str:
    return (f"BLAS workspaces {workspace_bytes(compute_capability, software, arch) / MiB:.0f} MiB reserved "
            "(CublasHandlePool.cpp defaults, for the forward's thread and the backward's)")


# cuDNN's convolution workspaces: PyTorch allocates each algorithm's workspace through the caching allocator for the
# length of the convolution (aten/src/ATen/native/cudnn/Conv_v8.cpp, run_conv_plan / try_plans), and which
# algorithm (so how much) comes from cuDNN's heuristics on the GPU itself: nothing a CPU can replay. What they leave
# behind is fragmentation: on the public H100 rows (benchmarks/gpu-truth, ConvNeXt-V2-H, ViT-H/14, CLIP-L/336) the
# real reserved peak stood up to 5.1 % above the reserved peak simulated from the estimate's allocations, while
# the allocated peaks agreed within 1.2 %. CALIBRATED on those rows (not held out): an estimate for a GPU target
# whose update runs convolutions has its need raised by this fraction, and says so.
CONV_ALLOWANCE = 0.06


def has_convolutions(op_profile_json: str | None, target: str | None) -> bool:
    """Whether a census (probes/census.py) of `target` counted convolution ops."""
    try:
        profiles = json.loads(op_profile_json) if op_profile_json else {}
    except (TypeError, ValueError):
        return False
    profile = profiles.get(target) if target else None
    return isinstance(profile, dict) and any(r[0] in ("conv", "depthwise") for r in profile.get("ops", []))


def conv_note() -> str:
    return (f"+{CONV_ALLOWANCE:.0%} for cuDNN's convolution workspaces (not replayable on a CPU; calibrated on the "
            "public H100 rows, planner/models/overheads.py)")


# The estimator's own error, for estimates of a GPU target: on the 15 public H100 rows (benchmarks/gpu-truth,
# benchmarks/gpu_truth.py) the estimate's allocated peak read up to 1.0 % under the real active peak
# (convnext2h-16-fp32 0.990, vith-64-amp 0.993, t5large-6x512-fp16 0.997), and with the simulated reserved peak at
# 0.999-1.000 of the real one the two T5-large rows planned 8 and 54 MiB short of what they really reserved: a
# false fit. CALIBRATED on those rows as the largest shortfall seen (with any one row left out, the others' largest
# is still 0.7 % or more, which covers each T5 row's shortfall). Every estimate that sizes a GPU offer gets it,
# whichever kernels it was made with; a line measured on a GPU carries that GPU's own peaks and does not.
ESTIMATE_ALLOWANCE = 0.010


def estimate_note() -> str:
    return (f"+{ESTIMATE_ALLOWANCE:.1%} for the estimator's own error (its allocated peak read up to that much under "
            "the real active peak on the public H100 runs of sanketpurandare/mem-run-estimator, kept in rentplan's "
            "benchmarks/gpu-truth; planner/models/overheads.py)")
