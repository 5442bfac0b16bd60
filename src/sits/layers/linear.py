"""Fused linear layers: one weight holding several projections stacked along the output rows.

Invariants: a `FusedLinear` of parts with output sizes [n0, n1, ...] has weight
[sum(n), in_features] (and bias [sum(n)]); part j owns rows offsets[j]:offsets[j + 1]. The
loader fills parts separately (q/k/v -> qkv_proj, gate/up -> gate_up_proj) through
`part_rows`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FusedLinear(nn.Module):
    """y = x @ weight.T (+ bias) where weight stacks several projections.

    Attributes:
        weight: [sum(part_sizes), in_features].
        bias: [sum(part_sizes)] or None.
        part_sizes: output rows of each part, in order.
    """

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.part_sizes = tuple(part_sizes)
        out_features = sum(part_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def part_rows(self, part: int) -> slice:
        """Rows of `weight` (and entries of `bias`) holding part `part`."""
        start = sum(self.part_sizes[:part])
        return slice(start, start + self.part_sizes[part])

    def forward(self, x: Tensor) -> Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, sum(part_sizes)]."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, parts={self.part_sizes}, bias={self.bias is not None}"


class QKVLinear(FusedLinear):
    """Query, key and value projections in one weight [(H + 2K) * D, hidden] (parts q, k, v)."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias=bias)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward_split(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project and split into heads.

        Args:
            x: [num_tokens, hidden_size].

        Returns:
            q [num_tokens, num_heads, head_dim], k and v [num_tokens, num_kv_heads, head_dim].
        """
        num_tokens = x.shape[0]
        qkv = self.forward(x)  # [num_tokens, (H + 2K) * D]
        q, k, v = qkv.split(list(self.part_sizes), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v


class GateUpLinear(FusedLinear):
    """Gate and up projections of a gated MLP in one weight [2 * I, hidden] (parts gate, up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], bias=bias)
