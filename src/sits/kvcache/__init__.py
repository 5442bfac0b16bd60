"""kvcache layer: paged KV block bookkeeping and the prefix cache (pure Python, no device).

`BlockPool` owns blocks, reference counts and the LRU free queue; `KVCacheManager` owns each
request's block table and the chained-hash prefix lookups (see `hashing`). Block 0 is the
reserved null block (`NULL_BLOCK_ID`). `HostBlockPool` tracks the host tier's blocks (swap
preemption).
"""

from __future__ import annotations

from sits.kvcache.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from sits.kvcache.hashing import BlockHash, hash_block_tokens, hash_full_blocks
from sits.kvcache.host_pool import HostBlockPool, SwapStats
from sits.kvcache.kv_manager import KVCacheManager, PrefixCacheStats, cdiv

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "HostBlockPool",
    "KVCacheManager",
    "PrefixCacheStats",
    "SwapStats",
    "cdiv",
    "hash_block_tokens",
    "hash_full_blocks",
]
