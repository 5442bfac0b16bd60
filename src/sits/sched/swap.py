"""`SwapPlanner`: the scheduler's side of the host KV tier (which host blocks, which copies).

Responsibility: decide whether a victim is swapped to the host tier or recomputed
(`SwapCostModel` and allocatable host blocks), hold each swapped-out request's host block ids,
turn swap-outs and swap-ins into (source, destination) block pairs for the `StepPlan`, own the
host tier's prefix cache (`prefix_tier`, given to the `KVCacheManager`) and add its copies to
the plan, and count everything in `SwapStats`. Pure bookkeeping (no torch), like the rest of
`sched`.

Invariants:
- A swapped-out request holds exactly cdiv(num_computed_tokens, block_size) host blocks, in
  block-table order, until it is swapped in or dropped. Its blocks take precedence over cached
  prefix blocks: a swap-out may evict those (least recently used first), never the reverse.
- Host blocks read by a plan's swap-ins are freed only at the next `begin_step()` (after the
  runner ran that plan), so no swap-out of the same plan can overwrite them first
  (`HostBlockPool` pins them).
- Without host blocks (`enabled` False) no request is ever swapped and no host block is ever
  used, so the callers skip `begin_step`, `end_step`, `is_swapped` and `drop` (the per-step
  bookkeeping); `swap_out` still runs on a preemption, to count the recompute.
"""

from __future__ import annotations

from sits.core.request import Request
from sits.kvcache.host_pool import HostBlockPool, SwapStats
from sits.kvcache.host_prefix import HostPrefixTier
from sits.kvcache.kv_manager import cdiv
from sits.sched.config import SchedulerConfig


class SwapPlanner:
    """Host-tier block bookkeeping and swap-or-recompute decisions.

    Args:
        config: the scheduler config (num_host_blocks, kv_bytes_per_block, swap_cost,
            block_size, enable_prefix_caching). num_host_blocks == 0: every preemption
            recomputes and the prefix cache is device-only.

    Attributes:
        enabled: the tier has host blocks (num_host_blocks > 0); False: callers skip the
            per-step bookkeeping (see the module docstring).
        host: the host tier's block pool.
        stats: cumulative counters (swap preemption and host prefix cache).
        prefix_tier: the host tier's prefix cache, or None (no host blocks, or prefix
            caching off).
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.enabled = config.num_host_blocks > 0
        self.host = HostBlockPool(config.num_host_blocks)
        self.stats = SwapStats()
        self.prefix_tier: HostPrefixTier | None = None
        if self.enabled and config.enable_prefix_caching:
            self.prefix_tier = HostPrefixTier(self.host, self.stats, config.kv_bytes_per_block)
        self._host_ids: dict[str, list[int]] = {}  # swapped-out request -> its host blocks

    @property
    def num_swapped(self) -> int:
        """Requests whose KV is on the host now."""
        return len(self._host_ids)

    def begin_step(self) -> None:
        """Free the host blocks of the previous plan's swap-ins (the runner has read them) and
        unpin the blocks its copies used."""
        self.host.begin_step()

    def end_step(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Append the host prefix cache's copies of this step to the plan's copy lists."""
        if self.prefix_tier is not None:
            offloads, loads = self.prefix_tier.take_copies()
            swap_out.extend(offloads)
            swap_in.extend(loads)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._host_ids

    def swap_out(self, request: Request, block_ids: list[int]) -> list[tuple[int, int]] | None:
        """Swap a victim's computed blocks out if worth it; else count a recompute.

        Args:
            request: the victim (still holding its device blocks).
            block_ids: its block table (device block ids).

        Returns:
            (device block, host block) pairs to copy, or None when it must recompute (no
            computed tokens, too few allocatable host blocks, or recompute is cheaper). The
            caller keeps `num_computed_tokens` on a swap and zeroes it on None.
        """
        num_computed = request.num_computed_tokens
        num_blocks = cdiv(num_computed, self.config.block_size)
        assert num_blocks <= len(block_ids), (request.request_id, num_blocks, block_ids)
        num_bytes = num_blocks * self.config.kv_bytes_per_block
        if (
            num_blocks == 0
            or num_blocks > self.host.num_allocatable_blocks
            or not self.config.swap_cost.prefers_swap(num_computed, num_bytes)
        ):
            self.stats.num_recompute_preemptions += 1
            self.stats.num_recomputed_tokens += num_computed
            return None
        host_ids = self.host.allocate(num_blocks)
        self._host_ids[request.request_id] = host_ids
        self.stats.num_swap_preemptions += 1
        self.stats.num_swap_out_blocks += num_blocks
        self.stats.num_swapped_bytes += num_bytes
        return list(zip(block_ids[:num_blocks], host_ids))

    def swap_in(self, request_id: str, block_ids: list[int]) -> list[tuple[int, int]]:
        """(host block, device block) pairs that restore a swapped request into its new table
        `block_ids`; its host blocks are freed at the next `begin_step()`."""
        host_ids = self._host_ids.pop(request_id)
        assert len(host_ids) <= len(block_ids), (request_id, host_ids, block_ids)
        self.host.read(host_ids)
        self.host.free(host_ids)  # pinned: free from the next step on
        self.stats.num_swap_in_blocks += len(host_ids)
        self.stats.num_swapped_bytes += len(host_ids) * self.config.kv_bytes_per_block
        return list(zip(host_ids, block_ids))

    def drop(self, request_id: str) -> None:
        """Free a finished (aborted) request's host blocks, if it was swapped out (its copy
        out ran in an earlier step)."""
        self.host.free(self._host_ids.pop(request_id, []))
