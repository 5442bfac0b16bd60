"""Gated activations: SiLU(gate) * up over a fused [gate | up] projection.

Invariant: the input's last dimension is 2 * d with the gate in the first half.

Algorithm: SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer").
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def silu_and_mul(x: Tensor) -> Tensor:
    """SiLU(x[..., :d]) * x[..., d:] for x: [..., 2 * d] -> [..., d], x's dtype."""
    gate, up = x.chunk(2, dim=-1)  # [..., d] each
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """Module form of `silu_and_mul` ([..., 2 * d] -> [..., d])."""

    def forward(self, x: Tensor) -> Tensor:
        return silu_and_mul(x)
