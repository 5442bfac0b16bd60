"""This process's place in a tensor-parallel group and the collectives over it.

Invariants:
- `TensorParallel` is a frozen value (rank, size); it holds no process group. Its collectives
  use torch.distributed's default group, which must be initialised (gloo on the CPU, NCCL on
  GPUs) before the first collective with size > 1; with size 1 they return their input and
  never touch torch.distributed, so a single process needs no group.
- `expert_parallel` only changes how MoE layers shard their experts (whole experts per rank,
  EP size = size, `layers.moe.SparseMoeBlock`); every other layer shards as without it.
- Every rank calls the same collectives in the same order with tensors of the same shape and
  dtype (the model's forward is identical on every rank), as torch.distributed requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from sits.core.errors import InvalidParameterError


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """Rank `rank` of `size` processes sharding one model.

    Attributes:
        rank: this process's index in [0, size).
        size: processes in the group (1 = no tensor parallelism).
        expert_parallel: MoE layers place whole experts on the ranks (rank r holds experts
            [r * E / size, (r + 1) * E / size)) instead of a slice of every expert
            (vLLM's `--enable-expert-parallel`; nothing changes with size 1).
    """

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"tensor parallel rank {self.rank} of size {self.size}: need size >= 1 and "
                f"0 <= rank < size",
            )

    def split(self, n: int, what: str) -> int:
        """This rank's share of `n` items split evenly: n // size.

        Raises:
            InvalidParameterError: size does not divide n (the message names `what`, n and
                size).
        """
        if n % self.size:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"tensor parallel size {self.size} does not divide {what} ({n})",
            )
        return n // self.size

    def shard(self, n: int, what: str) -> slice:
        """The items [rank * n / size, (rank + 1) * n / size) this rank holds of `n`.

        Raises:
            InvalidParameterError: size does not divide n (as `split`).
        """
        local = self.split(n, what)
        return slice(self.rank * local, (self.rank + 1) * local)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum x over the ranks, in place; returns x (x itself when size is 1)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: Tensor, dim: int = -1) -> Tensor:
        """Every rank's x concatenated in rank order along `dim` (x itself when size is 1).

        Args:
            x: this rank's tensor; same shape and dtype on every rank.
            dim: the dimension to concatenate along.

        Returns:
            A new tensor whose size along `dim` is size * x.shape[dim].
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()
