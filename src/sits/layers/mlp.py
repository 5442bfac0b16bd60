"""Dense gated MLP (SwiGLU): down(SiLU(gate(x)) * up(x)) with gate and up fused in one weight.

Invariant: `gate_up_proj` rows 0:I are the gate projection, I:2I the up projection.
"""

from __future__ import annotations

from torch import Tensor, nn

from sits.layers.activation import silu_and_mul
from sits.layers.linear import GateUpLinear


class GatedMLP(nn.Module):
    """The feed-forward block of Llama/Qwen/Mixtral-style decoders.

    Attributes:
        gate_up_proj: [2 * intermediate_size, hidden_size] (+ bias when `bias`).
        down_proj: [hidden_size, intermediate_size] (+ bias when `bias`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        gate_up = self.gate_up_proj(hidden)  # [num_tokens, 2 * intermediate_size]
        return self.down_proj(silu_and_mul(gate_up))
