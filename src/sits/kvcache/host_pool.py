"""`HostBlockPool`: bookkeeping of the host (CPU) KV tier's blocks, for swap preemption.

Responsibility: which host block ids hold a swapped-out request's KV. Pure bookkeeping: the
host tensors live in the runner (`sits.runner.swap`), with the device cache's per-block layout.

Invariants:
- Host block ids are 0..num_blocks-1 (no null block: host blocks never appear in a block
  table); each is either free or held by exactly one swapped-out request.
- Allocation takes the lowest free ids first (a deterministic order, so tests can assert
  exact ids); freed ids become allocatable again at once, so callers must only free a block
  once no pending copy reads it (the scheduler defers frees of swapped-in blocks by a step).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class SwapStats:
    """Cumulative swap and recompute counters (monotonic, for Prometheus counters).

    Attributes:
        num_swap_preemptions: preemptions that swapped the request's blocks out.
        num_recompute_preemptions: preemptions that dropped the request's KV.
        num_swap_out_blocks: blocks copied device -> host.
        num_swap_in_blocks: blocks copied host -> device.
        num_swapped_bytes: bytes copied in both directions.
        num_recomputed_tokens: computed tokens dropped by recompute preemptions, which are
            computed again as prefill when the request resumes (prefix-cache hits at resume
            are not deducted).
    """

    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_out_blocks: int = 0
    num_swap_in_blocks: int = 0
    num_swapped_bytes: int = 0
    num_recomputed_tokens: int = 0


class HostBlockPool:
    """Fixed pool of `num_blocks` host KV blocks.

    Args:
        num_blocks: host blocks (>= 0; 0 disables the tier).

    Raises:
        ValueError: num_blocks < 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free_ids = list(range(num_blocks))  # a min-heap (sorted list is a valid heap)
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        return len(self._used)

    def allocate(self, num_blocks: int) -> list[int]:
        """The `num_blocks` lowest free host block ids, now in use.

        Raises:
            ValueError: fewer free blocks than asked (callers check first).
        """
        if num_blocks > len(self._free_ids):
            raise ValueError(f"cannot allocate {num_blocks} host blocks, {self.num_free_blocks}")
        block_ids = [heapq.heappop(self._free_ids) for _ in range(num_blocks)]
        self._used.update(block_ids)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return host blocks to the pool (each must be in use)."""
        for block_id in block_ids:
            assert block_id in self._used, block_id
            self._used.remove(block_id)
            heapq.heappush(self._free_ids, block_id)
