"""Dense gated MLP (SwiGLU): down(SiLU(gate(x)) * up(x)) with gate and up fused in one weight.

Invariants: `gate_up_proj` rows 0:I are the gate projection, I:2I the up projection. Under
tensor parallelism I is this rank's slice of the intermediate dimension (rows
[r * I_total / size, (r + 1) * I_total / size) of gate and of up, the same columns of down);
`down_proj` sums its output over the ranks and adds its bias once.
"""

from __future__ import annotations

from torch import Tensor, nn

from sits.layers.activation import silu_and_mul
from sits.layers.linear import GateUpLinear, RowParallelLinear, Shard
from sits.parallel import SINGLE, TensorParallel


class GatedMLP(nn.Module):
    """The feed-forward block of Llama/Qwen/Mixtral-style decoders.

    Attributes:
        gate_up_proj: [2 * I, hidden_size] (+ bias when `bias`), I = intermediate_size / tp.size.
        down_proj: [hidden_size, I] (+ bias [hidden_size] when `bias`), summed over the ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """Raises InvalidParameterError when tp.size does not divide intermediate_size."""
        super().__init__()
        shard = Shard.of(intermediate_size, tp, "intermediate_size")
        self.gate_up_proj = GateUpLinear(hidden_size, shard.size, bias=bias, shard=shard)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, tp, "intermediate_size"
        )

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden: [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        gate_up = self.gate_up_proj(hidden)  # [num_tokens, 2 * I]
        return self.down_proj(silu_and_mul(gate_up))
