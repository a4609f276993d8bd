"""Which kernels a GPU runs for the ops whose memory differs by kernel: the rules, without torch.

Estimates are made for a kernel target, not for one GPU: GPUs that dispatch the same kernels for the same
model share one estimate. Two CUDA targets cover the catalog:
  sm80+    sm 8.0 and newer (A100, A10, L4, RTX 30xx/40xx, H100, H200, B200): flash attention for fp16/bf16
  sm50-75  sm 5.0 to 7.5 (V100, T4, P100): memory-efficient attention; no bf16, so fp16 with a scaler
and `cpu`: the CPU build's own kernels (what a CPU pilot runs). ROCm GPUs (MI250, MI300X) run AOTriton's
flash and memory-efficient kernels with the same saved tensors; they take the sm80+ target and say so.

The attention rule follows PyTorch's CUDA dispatch (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
select_sdp_backend tries flash, then memory-efficient, then math; can_use_flash_attention,
can_use_mem_efficient_attention and check_head_dim_size_mem_efficient / minimum_gemm_alignment give the
conditions below). On sm90/sm100 with cuDNN newer than 9.15 PyTorch may put cuDNN attention first
(check_prefer_cudnn_attention); it saves the same output and logsumexp as flash, so memory is the same.
"""

from __future__ import annotations

TARGETS = ("sm80+", "sm50-75", "cpu")
REPRESENTATIVE_SM = {"sm80+": (8, 0), "sm50-75": (7, 5)}
HALF = ("float16", "bfloat16")


def kernel_target(compute_capability: str | None, software: str = "cuda") -> str:
    """The kernel target of a catalog GPU (its compute capability, e.g. '8.9')."""
    if software == "rocm":
        return "sm80+"
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        return "sm80+"
    return "sm80+" if major >= 8 else "sm50-75"


def _sm_in(sm: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= sm <= hi


def gemm_alignment(sm: tuple[int, int], dtype: str) -> int:
    """minimum_gemm_alignment (sdp_utils.cpp): tensor cores on sm80+ (all dtypes) and on sm7x for half."""
    half = dtype in HALF
    use_tc = sm[0] >= 8 or (sm[0] >= 7 and half)
    align = 4 if sm[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if use_tc else align


def attention_backend(sm: tuple[int, int], dtype: str, head_dim_qk: int, head_dim_v: int, has_mask: bool,
                      dropout: float, is_causal: bool, q_len: int, k_len: int, training: bool,
                      last_dim_contiguous: bool = True) -> str:
    """'flash', 'efficient' or 'math': what F.scaled_dot_product_attention runs on a CUDA GPU of this sm."""
    flash = (
        not has_mask and last_dim_contiguous
        and head_dim_qk == head_dim_v and head_dim_qk <= 256
        and _sm_in(sm, (8, 0), (12, 1)) and dtype in HALF
        and not (is_causal and q_len != k_len)
        # sm86/89/120: flash's backward fails for head_dim in (192, 224], or > 224 with dropout
        and not (training and (_sm_in(sm, (8, 6), (8, 9)) or _sm_in(sm, (12, 0), (12, 1)))
                 and not (head_dim_qk <= 192 or (dropout == 0 and head_dim_qk > 224)))
    )
    if flash:
        return "flash"
    align = gemm_alignment(sm, dtype)
    dtypes = ("float16", "float32", "bfloat16") if sm[0] >= 8 else ("float16", "float32")
    efficient = (
        _sm_in(sm, (5, 0), (12, 1)) and last_dim_contiguous and dtype in dtypes
        and head_dim_qk > 0 and head_dim_qk % align == 0 and head_dim_v % align == 0
    )
    return "efficient" if efficient else "math"
