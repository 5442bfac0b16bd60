"""`BlockPool`: the KV cache's fixed-size blocks, their reference counts, free queue and hashes.

Responsibility: which block ids are in use, by how many requests, and which free blocks still
hold a reusable cached prefix. It knows nothing of requests (see `KVCacheManager`).

Invariants:
- Block 0 is the reserved NULL block: never allocated, never freed, never cached. Runners pad
  block tables with 0 and may point padding slots at it, so it must not hold live KV.
- A usable block (ids 1..num_blocks-1) is either in use (`ref_count >= 1`, not in the free
  queue) or free (`ref_count == 0`, in the free queue); `num_free_blocks` counts the latter.
- A free block may keep its hash ("cached free"): it stays reusable by a prefix hit until it
  is reallocated. Allocation takes blocks from the HEAD of the free queue and freed blocks are
  appended at the TAIL, so cached free blocks are evicted least-recently-freed first (LRU).
- `_cached_block_ids[h] == b` implies block b holds hash h and its token ids; at most one block
  is registered per hash (a later duplicate stays uncached).
- With `record_evictions`, every registered block that `allocate` takes away from the prefix
  cache is reported by the next `take_evicted()` (so a host tier can copy it out before the
  block is overwritten); nothing is recorded otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# A block hash (`kv_manager.hash_block_tokens`): the 32-byte SHA-256 digest (full width, so a
# collision of the parent chain is not a practical concern; the block's own token ids are
# still checked on every hit).
BlockHash = bytes

NULL_BLOCK_ID = 0


@dataclass(slots=True)
class KVBlock:
    """Bookkeeping of one KV block (its tensor storage lives in the runner).

    Attributes:
        block_id: index into the cache tensors' block dimension.
        ref_count: requests whose block table holds this block.
        block_hash: chained prefix hash when the block is full and cached, else None.
        token_ids: the block's token ids when cached (checked on a hit against collisions).
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


class EvictedBlock(NamedTuple):
    """A cached block `allocate` took from the prefix cache (its KV is still intact until the
    step that reuses the block writes it).

    Attributes:
        block_id: the device block, now allocated to a new user.
        block_hash: the hash it was registered under.
        token_ids: its token ids.
    """

    block_id: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]


class BlockPool:
    """Fixed pool of `num_blocks` KV blocks with reference counts and an LRU prefix cache.

    Args:
        num_blocks: blocks in the cache tensors, including the reserved null block 0.
        enable_caching: keep hashes of full blocks for prefix reuse.
        record_evictions: record the cached blocks `allocate` evicts (see `take_evicted`).

    Raises:
        ValueError: num_blocks < 2 (the null block plus at least one usable block).
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_evictions: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_evictions = record_evictions
        self._evicted: list[EvictedBlock] = []
        self._blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Ordered block ids; head = next to allocate (and evict), tail = most recently freed.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._cached_block_ids: dict[BlockHash, int] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user (including cached free blocks, which are evictable)."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return (self.num_usable_blocks - self.num_free_blocks) / self.num_usable_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first); for tests and debugging."""
        return list(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        """Number of users of a block."""
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The block's cached hash, or None."""
        return self._blocks[block_id].block_hash

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their hashes.

        Returns:
            Block ids in allocation order, each with ref_count 1.

        Raises:
            ValueError: fewer than `num_blocks` free blocks (callers check first).
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self._blocks[block_id]
            assert block.ref_count == 0, block
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a user to each block (a prefix hit); a free block leaves the free queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block_id != NULL_BLOCK_ID
            if block.ref_count == 0:
                del self._free_queue[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one user of each block, in the given order; unused blocks go to the tail.

        Callers free a request's table in reverse so its last blocks (least likely to be
        shared, since a hit needs the whole chain before them) are evicted first.
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, block
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block_id] = None

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block holding `block_hash` with exactly these token ids, or None."""
        block_id = self._cached_block_ids.get(block_hash)
        if block_id is None:
            return None
        block = self._blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None  # hash collision: never serve another prefix's KV
        return block_id

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block under its hash.

        Returns:
            True when registered; False when caching is off or another block already holds
            the hash (this block then stays uncached and is simply freed later).
        """
        block = self._blocks[block_id]
        assert block.ref_count > 0 and block_id != NULL_BLOCK_ID, block
        if not self.enable_caching or block_hash in self._cached_block_ids:
            return False
        assert block.block_hash is None, block
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached_block_ids[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use.

        Returns:
            True when reset, False when some block is still in use (nothing changed).
        """
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
            block.token_ids = None
        self._cached_block_ids.clear()
        return True

    def take_evicted(self) -> list[EvictedBlock]:
        """The cached blocks evicted by `allocate` since the last call, in eviction order."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached_block_ids.get(block.block_hash) == block.block_id:
            del self._cached_block_ids[block.block_hash]
            if self.record_evictions:
                assert block.token_ids is not None
                self._evicted.append(
                    EvictedBlock(block.block_id, block.block_hash, block.token_ids)
                )
        block.block_hash = None
        block.token_ids = None
