"""`KVCacheManager`: each request's block table, prefix-cache lookups and block caching.

Responsibility: turn "request R needs N more token slots" into block ids from the `BlockPool`,
find a request's longest cached prefix, and register blocks in the prefix cache once their KV
has actually been computed. Pure bookkeeping: no tensors, no device.

Invariants:
- A request's block table covers its computed tokens plus the tokens scheduled this step:
  `len(table) == cdiv(num_computed_tokens + num_new_tokens, block_size)` after allocation.
- A prefix hit never covers all of a request's tokens: at least one token is computed, so the
  model produces logits to sample from.
- Blocks are registered in the prefix cache only through `cache_full_blocks`, called after the
  step that computed them (never at scheduling time, when their KV is not written yet).
- Block hashes cover `request.all_token_ids` (prompt and outputs) chained in the request's
  namespace (`request.cache_salt`), so a preempted request can hit its own earlier blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.core.request import Request
from sits.kvcache.block_pool import BlockPool
from sits.kvcache.hashing import BlockHash, hash_full_blocks


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters (monotonic, for Prometheus counters).

    Attributes:
        num_requests: admissions that looked up the prefix cache.
        num_query_tokens: tokens those requests had when they looked up.
        num_hit_tokens: of those, tokens served from the cache.
    """

    num_requests: int = 0
    num_query_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens / query tokens (0 before any query)."""
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, with optional prefix caching.

    Args:
        num_blocks: blocks in the cache, including the reserved null block 0.
        block_size: tokens per block.
        enable_prefix_caching: look up and register full blocks by chained hash.

    Raises:
        ValueError: num_blocks < 2 or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading table blocks already registered

    @property
    def num_free_blocks(self) -> int:
        """Blocks not used by any request (cached free blocks included)."""
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks a request can ever use (all but the null block)."""
        return self.pool.num_usable_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list; copy before keeping it)."""
        return self._block_tables.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a request that holds no blocks yet.

        The lookup is skipped (no hit) when prefix caching is off or the request asked for
        prompt_logprobs (cached tokens have no logits). At most `num_tokens - 1` tokens hit, so
        when every token would hit, the last block is dropped and recomputed.

        Returns:
            (block ids to pass to `allocate_slots`, number of cached tokens =
            len(block ids) * block_size). The blocks are not referenced until allocated.
        """
        if not self._lookup_enabled(request):
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_hit_blocks)
        block_ids: list[int] = []
        tokens = request.all_token_ids
        for block_idx, block_hash in enumerate(hashes[:max_hit_blocks]):
            start = block_idx * self.block_size
            block_id = self.pool.lookup(block_hash, tokens[start : start + self.block_size])
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[int] | None = None,
        count_lookup: bool = True,
    ) -> bool:
        """Grow the request's table to hold its computed, newly hit and new tokens.

        Args:
            request: the request; `request.num_computed_tokens` excludes `new_computed_blocks`.
            num_new_tokens: tokens to compute this step (>= 1).
            new_computed_blocks: prefix-hit blocks from `get_computed_blocks` (only when the
                request holds no blocks yet).
            count_lookup: count a first allocation in the prefix-cache stats (False for a
                request resumed from the host tier, which did not look up the cache).

        Returns:
            True when allocated; False (nothing changed) when there are not enough free blocks.
        """
        assert num_new_tokens >= 1, num_new_tokens
        hit_block_ids = new_computed_blocks or []
        request_id = request.request_id
        table = self._block_tables.get(request_id)
        assert table is None or not hit_block_ids, "prefix hits only for a new request"
        num_held_blocks = len(hit_block_ids) + (len(table) if table else 0)
        num_total_tokens = (
            request.num_computed_tokens + len(hit_block_ids) * self.block_size + num_new_tokens
        )
        num_alloc_blocks = max(cdiv(num_total_tokens, self.block_size) - num_held_blocks, 0)
        # Hit blocks that sit in the free queue stop being free once referenced.
        num_free_hits = sum(1 for b in hit_block_ids if self.pool.ref_count(b) == 0)
        if num_alloc_blocks > self.pool.num_free_blocks - num_free_hits:
            return False
        if table is None:
            table = self._block_tables[request_id] = []
            self._num_cached_blocks[request_id] = len(hit_block_ids)
            if count_lookup and self._lookup_enabled(request):
                self.stats.num_requests += 1
                self.stats.num_query_tokens += request.num_tokens
                self.stats.num_hit_tokens += len(hit_block_ids) * self.block_size
        self.pool.touch(hit_block_ids)
        table.extend(hit_block_ids)
        table.extend(self.pool.allocate(num_alloc_blocks))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed in the prefix cache.

        Call after the step that computed the tokens (their KV is written).

        Args:
            request: a request holding blocks.
            num_computed_tokens: tokens of the request whose KV is now in the cache.
        """
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        table = self._block_tables[request_id]
        num_full_blocks = min(num_computed_tokens // self.block_size, len(table))
        first_block = self._num_cached_blocks[request_id]
        if num_full_blocks <= first_block:
            return
        hashes = self._hashes(request, num_full_blocks)
        tokens = request.all_token_ids
        for block_idx in range(first_block, num_full_blocks):
            start = block_idx * self.block_size
            end = start + self.block_size
            self.pool.cache_block(table[block_idx], hashes[block_idx], tokens[start:end])
        self._num_cached_blocks[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (last block first, see `BlockPool.free`); idempotent."""
        request_id = request.request_id
        table = self._block_tables.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only when no request holds blocks (see BlockPool)."""
        return self.pool.reset_prefix_cache()

    def _lookup_enabled(self, request: Request) -> bool:
        return self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's chained block hashes, computed at least for `num_blocks` blocks."""
        hashes = self._block_hashes.get(request.request_id, [])
        if len(hashes) < num_blocks:
            hashes = hash_full_blocks(
                request.all_token_ids,
                self.block_size,
                request.cache_salt,
                prev_hashes=hashes,
                max_num_blocks=num_blocks,
            )
            self._block_hashes[request.request_id] = hashes
        return hashes
