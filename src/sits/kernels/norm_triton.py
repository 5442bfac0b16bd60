"""Triton kernel: RMSNorm with an optional fused residual add, one program per token row.

Twin of `sits.layers.norm.RMSNorm.forward` (the PyTorch reference and CPU path), with the same
rounding steps, so that bfloat16 results match it bit for bit up to the order of the float32
sum of squares (at most 1 ulp of the output apart):
    s = dtype(x + residual)                      # residual_out, as torch's `x + residual`
    rstd = rsqrt(sum(float32(s)^2) / H + eps)    # float32
    out = dtype(weight * dtype(float32(s) * rstd))

Invariants:
- One program normalises one whole row (H up to MAX_HIDDEN elements, held in registers), so
  one launch does the add, the reduction and the scaling: no intermediate tensor in memory.
- Row strides may be anything; the hidden dimension must be contiguous.
- Compiled with `enable_fp_fusion=False`: the compiler would otherwise contract a bfloat16
  product and the following add into one fma (one rounding instead of the reference's two).
- No host synchronisation: capturable in a CUDA graph.

Algorithm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import next_power_of_2

MAX_HIDDEN = 16384  # widest row one program holds in registers


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    inv_hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program t: out[t] = rmsnorm(x[t] (+ residual[t])) * weight; residual_out[t] = the sum."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        summed = (x + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)  # the rounded sum, as the reference normalises it
    mean_square = tl.sum(x * x, axis=0) * inv_hidden_size  # torch's mean: sum * (1 / H)
    rstd = tl.rsqrt(mean_square + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (normed * weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)


def rms_norm_num_warps(hidden_size: int) -> int:
    """Warps per row program: about 8 elements per thread, between 1 and 16 warps."""
    return max(1, min(16, next_power_of_2(hidden_size) // 256))


def triton_rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    num_warps: int | None = None,
) -> tuple[Tensor, Tensor]:
    """RMSNorm of x (+ residual) in one kernel (Triton twin of `RMSNorm.forward`).

    Args:
        x: [num_tokens, hidden_size], float32/float16/bfloat16, last dimension contiguous.
        weight: [hidden_size], x's dtype, contiguous.
        eps: added to the mean square.
        residual: [num_tokens, hidden_size] in x's dtype (last dimension contiguous), or None.
        num_warps: warps per program; None = `rms_norm_num_warps(hidden_size)`.

    Returns:
        (normalised, residual_out), each [num_tokens, hidden_size] in x's dtype: normalised is
        a new contiguous tensor; residual_out is a new tensor x + residual, or x itself when
        residual is None (as the reference returns it).

    Raises:
        ValueError: a shape, dtype or layout the kernel does not take (callers fall back to
            the PyTorch reference).
    """
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"x must be [tokens, <= {MAX_HIDDEN}] with contiguous rows")
    num_tokens, hidden_size = x.shape
    if weight.shape != (hidden_size,) or weight.dtype != x.dtype or weight.stride(0) != 1:
        raise ValueError("weight must be [hidden_size] contiguous in x's dtype")
    if residual is not None and (
        residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1
    ):
        raise ValueError("residual must match x's shape and dtype with contiguous rows")
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    residual_out = x if residual is None else torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,  # unused without a residual
        weight,
        out,
        residual_out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        residual_out.stride(0),
        hidden_size,
        1.0 / hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=next_power_of_2(hidden_size),
        num_warps=num_warps or rms_norm_num_warps(hidden_size),
        enable_fp_fusion=False,  # no fma: round each product as torch does
        **pdl_args(out),
    )
    return out, residual_out
