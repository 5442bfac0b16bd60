"""`HostPrefixTier`: the host tier's share of the prefix cache (a second, larger LRU level).

Responsibility: when the device reuses a free block that still holds a cached prefix block,
keep a copy of it in a host block under the same hash (`offload`); when a prefix lookup misses
on the device but finds the hash on the host, copy it back into a new device block (`reserve`
then `load`) instead of recomputing it. It collects the step's (device, host) and (host,
device) block copies for the `StepPlan` and counts them in `SwapStats`. Pure bookkeeping.

Invariants:
- An offload copy reads a device block in the same step that `BlockPool.allocate` handed the
  block to a new user; the runner runs every swap-out before every swap-in and before the
  step's forward, so the copy sees the old KV.
- Host blocks read by a hit are pinned (`HostBlockPool.read`) BEFORE the device blocks for the
  hit are allocated, so the offloads that allocation causes cannot evict them.
- Host blocks held by swapped-out requests are never taken for a prefix block (`store` only
  takes free or cached blocks); swap preemption may evict cached ones (`allocate`).
"""

from __future__ import annotations

from collections.abc import Sequence

from sits.kvcache.block_pool import BlockHash, EvictedBlock
from sits.kvcache.host_pool import HostBlockPool, SwapStats


class HostPrefixTier:
    """Host-tier prefix cache over a `HostBlockPool` shared with swap preemption.

    Args:
        host: the host block pool (num_blocks >= 1).
        stats: counters to update (the swap planner's, so /metrics sees one object).
        kv_bytes_per_block: bytes one KV block takes across layers (for the byte counter).
    """

    def __init__(self, host: HostBlockPool, stats: SwapStats, kv_bytes_per_block: int) -> None:
        assert host.num_blocks >= 1, host.num_blocks
        self.host = host
        self.stats = stats
        self.kv_bytes_per_block = kv_bytes_per_block
        self._swap_out: list[tuple[int, int]] = []  # (device, host) copies of this step
        self._swap_in: list[tuple[int, int]] = []  # (host, device) copies of this step

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The host block caching this hash and these token ids, or None."""
        return self.host.lookup(block_hash, token_ids)

    def reserve(self, host_block_ids: Sequence[int]) -> None:
        """Pin the host blocks of a hit for this step (call before allocating device blocks)."""
        self.host.read(host_block_ids)

    def load(self, host_block_ids: Sequence[int], device_block_ids: Sequence[int]) -> None:
        """Plan the copies of reserved host blocks into the hit's new device blocks."""
        assert len(host_block_ids) == len(device_block_ids)
        self._swap_in.extend(zip(host_block_ids, device_block_ids))
        self.stats.num_host_loaded_blocks += len(host_block_ids)
        self.stats.num_host_cache_bytes += len(host_block_ids) * self.kv_bytes_per_block

    def offload(self, evicted: Sequence[EvictedBlock]) -> None:
        """Plan copies of device-evicted prefix blocks into host blocks (see `HostBlockPool.
        store`: a hash already on the host, or a host tier with no block to spare, copies
        nothing)."""
        for block in evicted:
            host_id = self.host.store(block.block_hash, block.token_ids)
            if host_id is None:
                continue
            self._swap_out.append((block.block_id, host_id))
            self.stats.num_host_stored_blocks += 1
            self.stats.num_host_cache_bytes += self.kv_bytes_per_block

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (device, host) offloads and (host, device) loads; clears them."""
        copies = (self._swap_out, self._swap_in)
        self._swap_out, self._swap_in = [], []
        return copies
