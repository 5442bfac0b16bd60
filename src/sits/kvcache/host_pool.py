"""`HostBlockPool`: bookkeeping of the host (CPU) KV tier's blocks: swapped-out requests' blocks
and an LRU cache of prefix blocks the device evicted.

Responsibility: which host block ids hold a swapped-out request's KV ("held"), which hold a
cached prefix block under its chained hash ("cached"), and which are free. Pure bookkeeping:
the host tensors live in the runner (`sits.runner.swap`), with the device cache's per-block
layout.

Invariants:
- Host block ids are 0..num_blocks-1 (no null block: host blocks never appear in a block
  table); each is exactly one of free, held (by one swapped-out request) or cached (one hash).
- Held blocks take precedence: `allocate` takes the lowest free ids first, then evicts cached
  blocks least recently used first; `store` (a prefix block) takes a free block or evicts the
  LRU cached block, never a held one.
- A block written or read by the current step's copies ("pinned": `store`d or `read` since the
  last `begin_step()`) is neither evicted nor handed out again before the next `begin_step()`;
  freeing a pinned block defers it to then. So within one step's plan no host block is written
  twice, and none is overwritten before the step's swap-ins read it. (A block `allocate`d for a
  swapped request is not pinned: it is held until its request is swapped in, which `read`s it.)
- At most one cached block per hash; a cached block keeps its token ids, checked on a hit.
- LRU order: a cached block becomes most recently used when stored, read by a hit, or stored
  again (its hash evicted from the device once more).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sits.kvcache.block_pool import BlockHash


@dataclass(slots=True)
class SwapStats:
    """Cumulative host-tier counters (monotonic, for Prometheus counters).

    Attributes:
        num_swap_preemptions: preemptions that swapped the request's blocks out.
        num_recompute_preemptions: preemptions that dropped the request's KV.
        num_swap_out_blocks: blocks of swap preemptions copied device -> host.
        num_swap_in_blocks: blocks of swap preemptions copied host -> device.
        num_swapped_bytes: bytes of swap preemptions copied in both directions.
        num_recomputed_tokens: computed tokens dropped by recompute preemptions, which are
            computed again as prefill when the request resumes (prefix-cache hits at resume
            are not deducted).
        num_host_hit_tokens: prompt tokens a prefix lookup found in the host tier's prefix
            cache (after missing the device cache) and copied in instead of recomputing.
        num_host_stored_blocks: cached prefix blocks copied device -> host when the device
            evicted them (a hash the host already held is not copied again).
        num_host_loaded_blocks: host prefix blocks copied host -> device on a hit.
        num_host_cache_bytes: bytes of those prefix copies, both directions.
    """

    num_swap_preemptions: int = 0
    num_recompute_preemptions: int = 0
    num_swap_out_blocks: int = 0
    num_swap_in_blocks: int = 0
    num_swapped_bytes: int = 0
    num_recomputed_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_host_stored_blocks: int = 0
    num_host_loaded_blocks: int = 0
    num_host_cache_bytes: int = 0


@dataclass(slots=True)
class _CachedEntry:
    block_hash: BlockHash
    token_ids: tuple[int, ...]


class HostBlockPool:
    """Fixed pool of `num_blocks` host KV blocks: held by swapped requests, cached, or free.

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
        self._held: set[int] = set()
        self._cached: OrderedDict[int, _CachedEntry] = OrderedDict()  # head = least recent
        self._cached_ids: dict[BlockHash, int] = {}
        self._pinned: set[int] = set()  # written or read by this step's copies
        self._deferred_ids: list[int] = []  # freed while pinned: free at the next step

    @property
    def num_free_blocks(self) -> int:
        """Blocks no swapped request holds (cached blocks included, as they are evictable),
        except blocks freed this step that its copies still read."""
        return len(self._free_ids) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by swapped-out requests."""
        return len(self._held)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix block."""
        return len(self._cached)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks `allocate` can take now: free ones and cached ones not pinned this step."""
        num_pinned_cached = sum(1 for b in self._pinned if b in self._cached)
        return len(self._free_ids) + len(self._cached) - num_pinned_cached

    def cached_block_ids(self) -> list[int]:
        """Cached block ids, least recently used first (eviction order); for tests."""
        return list(self._cached)

    def begin_step(self) -> None:
        """Start a new step: unpin every block and free the blocks deferred while pinned."""
        self._pinned.clear()
        for block_id in self._deferred_ids:
            heapq.heappush(self._free_ids, block_id)
        self._deferred_ids = []

    # ------------------------------------------------------------------ swapped requests
    def allocate(self, num_blocks: int) -> list[int]:
        """Blocks for a swapped-out request: the lowest free ids, then the least recently used
        unpinned cached blocks (their hashes are forgotten); now held.

        Raises:
            ValueError: fewer allocatable blocks than asked (callers check first).
        """
        if num_blocks > self.num_allocatable_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} host blocks, {self.num_allocatable_blocks}"
            )
        block_ids = []
        while len(block_ids) < num_blocks and self._free_ids:
            block_ids.append(heapq.heappop(self._free_ids))
        while len(block_ids) < num_blocks:
            block_id = self._evict_lru()
            assert block_id is not None
            block_ids.append(block_id)
        self._held.update(block_ids)
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return held blocks (each must be held); a pinned one is freed at the next step."""
        for block_id in block_ids:
            assert block_id in self._held, block_id
            self._held.remove(block_id)
            self._release(block_id)

    def read(self, block_ids: Iterable[int]) -> None:
        """Pin blocks read by this step's swap-ins (held or cached); a cached one becomes the
        most recently used."""
        for block_id in block_ids:
            assert block_id in self._held or block_id in self._cached, block_id
            self._pinned.add(block_id)
            if block_id in self._cached:
                self._cached.move_to_end(block_id)

    # --------------------------------------------------------------------- prefix cache
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block holding `block_hash` with exactly these token ids, or None."""
        block_id = self._cached_ids.get(block_hash)
        if block_id is None or self._cached[block_id].token_ids != tuple(token_ids):
            return None  # a miss, or a hash collision: never serve another prefix's KV
        return block_id

    def store(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """Make room for a prefix block the device evicts.

        Returns:
            The block to copy it into (now cached, pinned, most recently used): the lowest
            free id, else the least recently used unpinned cached block. None when nothing is
            to be copied: the hash is cached already (it becomes most recently used) or every
            block is held or pinned.
        """
        cached_id = self._cached_ids.get(block_hash)
        if cached_id is not None:
            self._cached.move_to_end(cached_id)
            return None
        block_id = heapq.heappop(self._free_ids) if self._free_ids else self._evict_lru()
        if block_id is None:
            return None
        self._cached[block_id] = _CachedEntry(block_hash, tuple(token_ids))
        self._cached_ids[block_hash] = block_id
        self._pinned.add(block_id)
        return block_id

    def reset_cache(self) -> None:
        """Forget every cached prefix block (held blocks stay)."""
        for block_id in list(self._cached):
            del self._cached[block_id]
            self._release(block_id)
        self._cached_ids.clear()

    def _evict_lru(self) -> int | None:
        """Uncache the least recently used unpinned cached block and return its id (None: every
        cached block is pinned). Pinned blocks were moved to the tail, so the scan is short."""
        block_id = next((b for b in self._cached if b not in self._pinned), None)
        if block_id is None:
            return None
        entry = self._cached.pop(block_id)
        del self._cached_ids[entry.block_hash]
        return block_id

    def _release(self, block_id: int) -> None:
        if block_id in self._pinned:
            self._deferred_ids.append(block_id)
        else:
            heapq.heappush(self._free_ids, block_id)
