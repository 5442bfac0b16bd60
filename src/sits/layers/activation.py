"""Gated activations: SiLU(gate) * up over a fused [gate | up] projection.

Invariant: the input's last dimension is 2 * d with the gate in the first half.

On CUDA with Triton installed, `silu_and_mul` runs one Triton kernel
(`sits.kernels.activation_triton`, imported only then) with the same rounding steps;
`silu_and_mul_reference` is its reference and the CPU path.

Algorithm: SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer").
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from sits.kernels.triton_utils import has_triton


def silu_and_mul(x: Tensor) -> Tensor:
    """SiLU(x[..., :d]) * x[..., d:] for x: [..., 2 * d] -> [..., d], x's dtype."""
    if x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and has_triton():
        from sits.kernels.activation_triton import triton_silu_and_mul

        return triton_silu_and_mul(x)
    return silu_and_mul_reference(x)


def silu_and_mul_reference(x: Tensor) -> Tensor:
    """`silu_and_mul` in PyTorch: the Triton kernel's reference and the CPU path."""
    gate, up = x.chunk(2, dim=-1)  # [..., d] each
    return F.silu(gate) * up
