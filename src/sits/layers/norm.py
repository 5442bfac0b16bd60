"""RMSNorm with an optional fused residual add.

Invariants: the mean of squares and the normalisation are computed in float32; the result is
cast back to the input dtype before the weight multiply (as Hugging Face Llama/Qwen do, so
bfloat16 outputs match). The residual add happens in the input dtype.

Algorithm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps) over the last dimension.

    Attributes:
        weight: [hidden_size] parameter.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def normalize(self, x: Tensor) -> Tensor:
        """RMSNorm of x: [..., hidden_size] -> [..., hidden_size], x's dtype."""
        x_f32 = x.float()
        variance = x_f32.pow(2).mean(dim=-1, keepdim=True)  # [..., 1]
        return self.weight * (x_f32 * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Add the residual (when given), then normalise.

        Args:
            x: [num_tokens, hidden_size].
            residual: [num_tokens, hidden_size] or None (first layer: x is the residual).

        Returns:
            (normalised x + residual, x + residual), both [num_tokens, hidden_size].
        """
        if residual is not None:
            x = x + residual
        return self.normalize(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
