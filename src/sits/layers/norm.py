"""RMSNorm with an optional fused residual add.

Invariants: the mean of squares and the normalisation are computed in float32; the result is
cast back to the input dtype before the weight multiply (as Hugging Face Llama/Qwen do, so
bfloat16 outputs match). The residual add happens in the input dtype.

On CUDA with Triton installed, `forward` runs one Triton kernel (`sits.kernels.norm_triton`,
imported only then) with the same rounding steps; the torch code here is its reference and the
CPU path.

Algorithm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sits.kernels.triton_utils import has_triton

MAX_TRITON_HIDDEN = 16384  # widest row of the Triton kernel (`norm_triton.MAX_HIDDEN`)


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
        if self._triton_applies(x, residual):
            from sits.kernels.norm_triton import triton_rms_norm

            return triton_rms_norm(x, self.weight, self.eps, residual)
        return self.forward_reference(x, residual)

    def forward_reference(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`forward` in PyTorch: the Triton kernel's reference and the CPU path."""
        if residual is not None:
            x = x + residual
        return self.normalize(x), x

    def _triton_applies(self, x: Tensor, residual: Tensor | None) -> bool:
        """True when the Triton kernel computes exactly what the torch path would: CUDA
        [tokens, hidden] tensors of one dtype (the weight too) with contiguous rows."""
        if not x.is_cuda or x.dim() != 2 or x.stride(1) != 1 or self.weight.dtype != x.dtype:
            return False
        if x.shape[1] > MAX_TRITON_HIDDEN:
            return False
        if residual is not None and (residual.dtype != x.dtype or residual.stride(1) != 1):
            return False
        return has_triton()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
