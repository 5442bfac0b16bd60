"""Linear layers: fused projections (several stacked along the output rows) and the row-parallel
projection of tensor parallelism.

Invariants:
- A `FusedLinear` of parts with output sizes [n0, n1, ...] has weight [sum(n), in_features]
  (and bias [sum(n)]); part j owns rows offsets[j]:offsets[j + 1]. The loader fills parts
  separately (q/k/v -> qkv_proj, gate/up -> gate_up_proj) through `part_rows`, each from the
  rows `part_shards[j]` of the checkpoint's part (all of them without tensor parallelism).
- Tensor parallelism (Megatron-LM's layout, Shoeybi et al. 2019): a fused projection is
  column-parallel (each rank holds some output rows of every part, no collective); a
  `RowParallelLinear` holds some input columns, sums its partial outputs over the ranks
  (`TensorParallel.all_reduce`) and adds its (whole) bias once, after the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sits.parallel import SINGLE, TensorParallel


@dataclass(frozen=True, slots=True)
class Shard:
    """The indices [start, stop) this rank holds of one checkpoint dimension of size `full`."""

    full: int
    start: int
    stop: int

    @classmethod
    def whole(cls, n: int) -> Shard:
        """All n indices (no tensor parallelism)."""
        return cls(n, 0, n)

    @classmethod
    def of(cls, n: int, tp: TensorParallel, what: str) -> Shard:
        """Rank tp.rank's even share of n (InvalidParameterError naming `what` when tp.size
        does not divide n)."""
        rows = tp.shard(n, what)
        return cls(n, rows.start, rows.stop)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == self.full


class FusedLinear(nn.Module):
    """y = x @ weight.T (+ bias) where weight stacks several projections.

    Attributes:
        weight: [sum(part_sizes), in_features].
        bias: [sum(part_sizes)] or None.
        part_sizes: output rows of each part, in order (this rank's).
        part_shards: per part, the rows of the checkpoint's part tensor this module holds.
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        bias: bool = False,
        part_shards: tuple[Shard, ...] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.part_sizes = tuple(part_sizes)
        if part_shards is None:
            part_shards = tuple(Shard.whole(n) for n in part_sizes)
        assert tuple(s.size for s in part_shards) == self.part_sizes, "shards must fit parts"
        self.part_shards = part_shards
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
    """Query, key and value projections in one weight [(H + 2K) * D, hidden] (parts q, k, v).

    Under tensor parallelism H and K are this rank's heads: q heads first_head .. + H and kv
    heads first_kv_head .. + K of the checkpoint's `total_heads` / `total_kv_heads`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        *,
        first_head: int = 0,
        total_heads: int | None = None,
        first_kv_head: int = 0,
        total_kv_heads: int | None = None,
    ) -> None:
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        total_q = (total_heads or num_heads) * head_dim
        total_kv = (total_kv_heads or num_kv_heads) * head_dim
        q_rows = Shard(total_q, first_head * head_dim, first_head * head_dim + q_size)
        kv_start = first_kv_head * head_dim
        kv_rows = Shard(total_kv, kv_start, kv_start + kv_size)
        super().__init__(
            hidden_size, [q_size, kv_size, kv_size], bias=bias,
            part_shards=(q_rows, kv_rows, kv_rows),
        )  # fmt: skip
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
    """Gate and up projections of a gated MLP in one weight [2 * I, hidden] (parts gate, up);
    `shard` (default: all) says which rows of the checkpoint's gate and up this rank holds."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        shard: Shard | None = None,
    ) -> None:
        shard = shard if shard is not None else Shard.whole(intermediate_size)
        super().__init__(
            hidden_size, [intermediate_size, intermediate_size], bias=bias,
            part_shards=(shard, shard),
        )  # fmt: skip


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of (x_local @ weight.T) + bias: the input columns split by rank.

    Attributes:
        weight: [out_features, in_features / tp.size], this rank's columns.
        bias: [out_features] (whole) or None, added once after the sum.
        col_shard: the columns of the checkpoint's weight this rank holds.
        tp: the tensor-parallel group.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: TensorParallel = SINGLE,
        what: str = "in_features",
    ) -> None:
        """Raises InvalidParameterError (naming `what`) when tp.size does not divide
        in_features."""
        col_shard = Shard.of(in_features, tp, what)
        super().__init__(col_shard.size, out_features, bias=bias)
        self.col_shard = col_shard
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        """x: [num_tokens, in_features / tp.size] -> [num_tokens, out_features], summed over
        the ranks (one all-reduce when tp.size > 1)."""
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        return sum_partial(F.linear(x, self.weight), self.bias, self.tp)


def sum_partial(partial: Tensor, bias: Tensor | None, tp: TensorParallel) -> Tensor:
    """A row-parallel projection's output from this rank's partial product.

    Args:
        partial: [num_tokens, out_features], x_local @ weight_local.T (no bias).
        bias: [out_features] (whole) or None, added once, after the sum.
        tp: the ranks to sum over (one all-reduce, in place).

    Returns:
        [num_tokens, out_features], partial's dtype.
    """
    out = tp.all_reduce(partial)  # [num_tokens, out_features]
    return out if bias is None else out + bias
