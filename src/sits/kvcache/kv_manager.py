"""`KVCacheManager`: each request's block table, prefix-cache lookups and block caching.

Responsibility: turn "request R needs N more token slots" into block ids from the `BlockPool`,
find a request's longest cached prefix, and register blocks in the prefix cache once their KV
has actually been computed. Pure bookkeeping: no tensors, no device.

Invariants:
- A request's block table covers its computed tokens plus the tokens scheduled this step:
  `len(table) == cdiv(num_computed_tokens + num_new_tokens, block_size)` after allocation.
- A prefix hit never covers all of a request's tokens: at least one token is computed, so the
  model produces logits to sample from.
- Blocks are registered in the prefix cache through `cache_full_blocks`, called after the
  step that computed them (never at scheduling time, when their KV is not written yet). The
  one exception: a block filled from the host tier is registered when its copy is planned, as
  the runner copies it in before the step's forward (so a later request of the same step may
  share it instead of copying the same host block again).
- Block hashes cover `request.all_token_ids` (prompt and outputs) chained in the request's
  namespace (`request.cache_salt`), so a preempted request can hit its own earlier blocks.
- With a host tier (`HostPrefixTier`), a lookup goes block by block: the device first, then the
  host; the hit ends at the first block found in neither. Every cached device block that an
  allocation evicts is offered to the host tier in the same call (`HostPrefixTier.offload`).

Block hashes, the prefix cache's keys: a chain of SHA-256 digests over full blocks of token
ids. A full block's hash is `sha256(version, parent_hash, namespace, token_ids)`, so two blocks
have the same hash only when their whole prefixes (every earlier block) and their namespaces
(the tenant's cache salt) are equal. The encoding is explicit and fixed-width, so a hash is
stable across processes, machines and Python versions (unlike Python's `hash()` of a tuple,
which is salted per process for strings). Only FULL blocks (exactly `block_size` token ids)
are hashed; `namespace=None` and `namespace=""` are different namespaces; token ids are
encoded as unsigned 64-bit little-endian integers (any vocabulary fits).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from sits.core.request import Request
from sits.kvcache.block_pool import BlockHash, BlockPool
from sits.kvcache.host_prefix import HostPrefixTier

NO_DEVICE_BLOCK = -1  # a `PrefixHit` block held only by the host tier
_VERSION = b"sits-kv-block-v1"  # the block hash's encoding version
_ROOT_PARENT = bytes(32)  # parent hash of a request's first block


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], namespace: str | None
) -> BlockHash:
    """Hash one full block chained to its parent block's hash.

    Args:
        parent_hash: hash of the previous block of the same sequence; None for the first block.
        token_ids: the block's token ids (non-negative ints, exactly one block's worth).
        namespace: the request's cache salt (tenant isolation); None when it has none.

    Returns:
        32-byte SHA-256 digest.
    """
    digest = hashlib.sha256(_VERSION)
    digest.update(_ROOT_PARENT if parent_hash is None else parent_hash)
    if namespace is None:
        digest.update(b"\x00")
    else:
        salt = namespace.encode("utf-8")
        digest.update(b"\x01" + struct.pack("<Q", len(salt)) + salt)
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str | None,
    prev_hashes: Sequence[BlockHash] = (),
    max_num_blocks: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids`, extending an already computed chain.

    Args:
        token_ids: the sequence's tokens (prompt then outputs).
        block_size: tokens per block.
        namespace: the request's cache salt, or None.
        prev_hashes: hashes already computed for the first `len(prev_hashes)` blocks; they are
            kept as they are (token ids of earlier blocks never change).
        max_num_blocks: hash at most this many blocks in all (None: every full block).

    Returns:
        A new list: `prev_hashes` followed by the hashes of the following full blocks.
    """
    num_full_blocks = len(token_ids) // block_size
    if max_num_blocks is not None:
        num_full_blocks = min(num_full_blocks, max_num_blocks)
    hashes = list(prev_hashes)
    parent = hashes[-1] if hashes else None
    for block_idx in range(len(hashes), num_full_blocks):
        start = block_idx * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes


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


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A new request's longest cached prefix, block by block (`get_computed_blocks`).

    Attributes:
        block_ids: per hit block, in order: its device block id, or NO_DEVICE_BLOCK (-1) where
            only the host tier holds it (a new device block is allocated and filled by a copy).
        host_block_ids: the host block ids of the NO_DEVICE_BLOCK entries, in order.
        num_tokens: cached tokens, len(block_ids) * block_size.
    """

    block_ids: tuple[int, ...] = ()
    host_block_ids: tuple[int, ...] = ()
    num_tokens: int = 0

    @property
    def device_block_ids(self) -> list[int]:
        """The hit blocks already on the device, in order."""
        return [b for b in self.block_ids if b != NO_DEVICE_BLOCK]


NO_HIT = PrefixHit()


class KVCacheManager:
    """Per-request block tables over one `BlockPool`, with optional prefix caching.

    Args:
        num_blocks: blocks in the cache, including the reserved null block 0.
        block_size: tokens per block.
        enable_prefix_caching: look up and register full blocks by chained hash.
        host_tier: the host tier's prefix cache (evicted blocks go there, lookups that miss
            on the device try it); None, or prefix caching off: device only.

    Raises:
        ValueError: num_blocks < 2 or block_size < 1.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostPrefixTier | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = host_tier if enable_prefix_caching else None
        self.pool = BlockPool(
            num_blocks,
            enable_caching=enable_prefix_caching,
            record_evictions=self.host_tier is not None,
        )
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

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """Longest cached prefix of a request that holds no blocks yet (device, then host).

        The lookup is skipped (no hit) when prefix caching is off or the request asked for
        prompt_logprobs (cached tokens have no logits). At most `num_tokens - 1` tokens hit, so
        when every token would hit, the last block is dropped and recomputed.

        Returns:
            The hit, to pass to `allocate_slots`. Nothing is referenced or pinned until then.
        """
        if not self._lookup_enabled(request):
            return NO_HIT
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, max_hit_blocks)
        block_ids: list[int] = []
        host_block_ids: list[int] = []
        tokens = request.all_token_ids
        for block_idx, block_hash in enumerate(hashes[:max_hit_blocks]):
            start = block_idx * self.block_size
            block_tokens = tokens[start : start + self.block_size]
            block_id = self.pool.lookup(block_hash, block_tokens)
            if block_id is None and self.host_tier is not None:
                host_id = self.host_tier.lookup(block_hash, block_tokens)
                if host_id is not None:
                    block_id = NO_DEVICE_BLOCK
                    host_block_ids.append(host_id)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixHit(tuple(block_ids), tuple(host_block_ids), len(block_ids) * self.block_size)

    def num_blocks_to_take(
        self, request: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT
    ) -> int:
        """Free-pool blocks `allocate_slots` would take: new blocks (one per host hit block
        included) plus device hit blocks that sit in the free queue."""
        table = self._block_tables.get(request.request_id, [])
        num_held = len(hit.block_ids) + len(table)
        num_total_tokens = request.num_computed_tokens + hit.num_tokens + num_new_tokens
        num_new_blocks = max(cdiv(num_total_tokens, self.block_size) - num_held, 0)
        num_free_hits = sum(1 for b in hit.device_block_ids if self.pool.ref_count(b) == 0)
        return num_new_blocks + len(hit.host_block_ids) + num_free_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: PrefixHit = NO_HIT,
        count_lookup: bool = True,
    ) -> bool:
        """Grow the request's table to hold its computed, newly hit and new tokens.

        Device hit blocks gain a reference; each host hit block gets a new device block,
        registered under its hash at once, with a host -> device copy planned
        (`HostPrefixTier.load`). Cached device blocks evicted by the allocation are offered to
        the host tier.

        Args:
            request: the request; `request.num_computed_tokens` excludes the hit's tokens.
            num_new_tokens: tokens to compute this step (>= 1).
            hit: prefix hit from `get_computed_blocks` (only when the request holds no blocks
                yet).
            count_lookup: count a first allocation in the prefix-cache stats (False for a
                request resumed from the host tier, which did not look up the cache).

        Returns:
            True when allocated; False (nothing changed) when there are not enough free blocks.
        """
        assert num_new_tokens >= 1, num_new_tokens
        request_id = request.request_id
        table = self._block_tables.get(request_id)
        assert table is None or not hit.block_ids, "prefix hits only for a new request"
        num_take = self.num_blocks_to_take(request, num_new_tokens, hit)
        if num_take > self.pool.num_free_blocks:
            return False
        device_hit_ids = hit.device_block_ids
        num_free_hits = sum(1 for b in device_hit_ids if self.pool.ref_count(b) == 0)
        if table is None:
            table = self._block_tables[request_id] = []
            self._num_cached_blocks[request_id] = len(hit.block_ids)
            if count_lookup and self._lookup_enabled(request):
                self.stats.num_requests += 1
                self.stats.num_query_tokens += request.num_tokens
                self.stats.num_hit_tokens += len(device_hit_ids) * self.block_size
        self.pool.touch(device_hit_ids)
        if hit.host_block_ids:
            assert self.host_tier is not None
            self.host_tier.reserve(hit.host_block_ids)
        new_block_ids = self.pool.allocate(num_take - num_free_hits)
        if self.host_tier is not None:
            self.host_tier.offload(self.pool.take_evicted())
        if hit.host_block_ids:
            num_loaded = len(hit.host_block_ids)
            table.extend(self._fill_host_hits(request, hit, new_block_ids[:num_loaded]))
            new_block_ids = new_block_ids[num_loaded:]
        else:
            table.extend(hit.block_ids)
        table.extend(new_block_ids)
        return True

    def _fill_host_hits(
        self, request: Request, hit: PrefixHit, loaded_block_ids: list[int]
    ) -> list[int]:
        """The hit's table part, host hits on their new device blocks (registered under their
        hashes, copies planned); counts the host-hit tokens."""
        assert self.host_tier is not None
        hashes = self._hashes(request, len(hit.block_ids))
        tokens = request.all_token_ids
        new_ids = iter(loaded_block_ids)
        block_ids = []
        for block_idx, block_id in enumerate(hit.block_ids):
            if block_id == NO_DEVICE_BLOCK:
                block_id = next(new_ids)
                start = block_idx * self.block_size
                block_tokens = tokens[start : start + self.block_size]
                registered = self.pool.cache_block(block_id, hashes[block_idx], block_tokens)
                assert registered, (request.request_id, block_idx)
            block_ids.append(block_id)
        self.host_tier.load(hit.host_block_ids, loaded_block_ids)
        self.host_tier.stats.num_host_hit_tokens += len(loaded_block_ids) * self.block_size
        return block_ids

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
        """Forget all cached prefixes, on the host tier too; only when no request holds device
        blocks (see BlockPool)."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.host.reset_cache()
        return True

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
