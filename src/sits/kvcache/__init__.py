"""kvcache layer: paged KV block bookkeeping and the prefix cache (pure Python, no device).

`BlockPool` owns blocks, reference counts and the LRU free queue; `KVCacheManager` owns each
request's block table and the chained-hash prefix lookups (`hash_full_blocks`). Block 0 is the
reserved null block (`NULL_BLOCK_ID`). `HostBlockPool` tracks the host tier's blocks (swapped-out
requests' blocks and an LRU of prefix blocks the device evicted); `HostPrefixTier` moves
evicted prefix blocks there and serves prefix hits from it.
"""

from __future__ import annotations

from sits.kvcache.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, EvictedBlock, KVBlock
from sits.kvcache.host_pool import HostBlockPool, SwapStats
from sits.kvcache.host_prefix import HostPrefixTier
from sits.kvcache.kv_manager import (
    NO_DEVICE_BLOCK,
    NO_HIT,
    KVCacheManager,
    PrefixCacheStats,
    PrefixHit,
    cdiv,
    hash_block_tokens,
    hash_full_blocks,
)

__all__ = [
    "NO_DEVICE_BLOCK",
    "NO_HIT",
    "NULL_BLOCK_ID",
    "BlockHash",
    "BlockPool",
    "EvictedBlock",
    "KVBlock",
    "HostBlockPool",
    "HostPrefixTier",
    "KVCacheManager",
    "PrefixCacheStats",
    "PrefixHit",
    "SwapStats",
    "cdiv",
    "hash_block_tokens",
    "hash_full_blocks",
]
