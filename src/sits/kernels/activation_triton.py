"""Triton kernel: SiLU(gate) * up over a fused [gate | up] row, in one pass.

Twin of `sits.layers.activation.silu_and_mul_reference` (the PyTorch reference and CPU path),
with its two roundings to the input dtype:
    act = dtype(silu(float32(gate)))           # torch's F.silu in the input dtype
    out = dtype(float32(act) * float32(up))    # torch's `act * up`
PyTorch runs these as two elementwise kernels over strided halves, with an intermediate
tensor in memory; this kernel reads each input element once and writes each output once
(3 * d elements of traffic per row instead of 5 * d).

Invariants:
- Program (row, column block): BLOCK output columns of one token row.
- Rows may have any stride; the last dimension must be contiguous.
- No host synchronisation: capturable in a CUDA graph.

Algorithm: SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"); SiLU (Elfwing et al.
2018) as x / (1 + exp(-x)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sits.kernels.pdl_triton import pdl_args, pdl_enter
from sits.kernels.triton_utils import cdiv

BLOCK = 1024  # output columns per program


@triton.jit
def silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    d,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (row, block): out[row, cols] = silu(x[row, cols]) * x[row, d + cols]."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)  # rounded as torch's F.silu output
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def triton_silu_and_mul(x: Tensor) -> Tensor:
    """SiLU(x[:, :d]) * x[:, d:] in one kernel.

    Args:
        x: [num_tokens, 2 * d], float32/float16/bfloat16, contiguous last dimension (rows may
            be strided).

    Returns:
        [num_tokens, d], x's dtype, contiguous.

    Raises:
        ValueError: x is not 2-D with an even, contiguous last dimension.
    """
    if x.dim() != 2 or x.shape[1] % 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"expected [tokens, 2 * d] with a contiguous last dimension, got {tuple(x.shape)}"
        )
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if num_tokens == 0 or d == 0:
        return out
    silu_and_mul_kernel[(num_tokens, cdiv(d, BLOCK))](
        x, out, d, x.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_args(out)
    )
    return out
