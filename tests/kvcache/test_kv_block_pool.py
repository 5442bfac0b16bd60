"""BlockPool: null block, reference counts, LRU free queue, hash registration and eviction."""

from __future__ import annotations

import pytest

from sits.kvcache.block_pool import NULL_BLOCK_ID, BlockPool
from sits.kvcache.kv_manager import hash_block_tokens


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(num_blocks=5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    assert pool.free_block_ids() == [1, 2, 3, 4]
    assert pool.allocate(4) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in pool.free_block_ids()
    assert pool.usage == 1.0
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, 0 free"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        BlockPool(num_blocks=1)


def test_reference_counts_with_sharing() -> None:
    pool = BlockPool(num_blocks=4)
    [a, b] = pool.allocate(2)
    pool.touch([a])  # a second request shares block a
    assert (pool.ref_count(a), pool.ref_count(b)) == (2, 1)
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    pool.free([b, a])
    assert pool.num_free_blocks == 3 and pool.usage == 0.0
    # Freed in the order b, a after the never-used block 3.
    assert pool.free_block_ids() == [3, b, a]


def test_cached_free_block_is_revived_by_touch() -> None:
    pool = BlockPool(num_blocks=4)
    [block] = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1, 2], None)
    assert pool.cache_block(block, block_hash, [1, 2])
    pool.free([block])
    assert pool.free_block_ids() == [2, 3, 1]
    assert pool.lookup(block_hash, [1, 2]) == 1  # still reusable while free
    pool.touch([1])
    assert pool.ref_count(1) == 1 and pool.free_block_ids() == [2, 3]
    assert pool.block_hash(1) == block_hash


def test_lru_eviction_order_and_hash_removal() -> None:
    pool = BlockPool(num_blocks=5)
    hashes = [hash_block_tokens(None, [i], None) for i in range(4)]
    blocks = pool.allocate(4)
    for block, block_hash, token in zip(blocks, hashes, range(4)):
        pool.cache_block(block, block_hash, [token])
    pool.free([3, 1, 4, 2])
    assert pool.free_block_ids() == [3, 1, 4, 2]
    # The least recently freed blocks are reallocated (and lose their hashes) first.
    assert pool.allocate(2) == [3, 1]
    assert pool.lookup(hashes[2], [2]) is None and pool.block_hash(3) is None
    assert pool.lookup(hashes[0], [0]) is None
    assert pool.lookup(hashes[3], [3]) == 4 and pool.lookup(hashes[1], [1]) == 2


def test_lookup_checks_token_ids_against_collisions() -> None:
    pool = BlockPool(num_blocks=3)
    [block] = pool.allocate(1)
    fake_hash = b"\x07" * 32
    pool.cache_block(block, fake_hash, [5, 6])
    assert pool.lookup(fake_hash, [5, 6]) == block
    assert pool.lookup(fake_hash, [5, 7]) is None


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(num_blocks=3)
    first, second = pool.allocate(2)
    block_hash = hash_block_tokens(None, [1], None)
    assert pool.cache_block(first, block_hash, [1])
    assert not pool.cache_block(second, block_hash, [1])
    assert pool.block_hash(second) is None
    pool.free([first])
    assert pool.allocate(1) == [first]  # evicts the hash
    assert pool.lookup(block_hash, [1]) is None
    # Now the duplicate can be registered.
    assert pool.cache_block(second, block_hash, [1])
    assert pool.lookup(block_hash, [1]) == second


def test_caching_disabled_registers_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    [block] = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1], None)
    assert not pool.cache_block(block, block_hash, [1])
    assert pool.lookup(block_hash, [1]) is None


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(num_blocks=3)
    [block] = pool.allocate(1)
    block_hash = hash_block_tokens(None, [1], None)
    pool.cache_block(block, block_hash, [1])
    assert not pool.reset_prefix_cache()
    assert pool.lookup(block_hash, [1]) == block
    pool.free([block])
    assert pool.reset_prefix_cache()
    assert pool.lookup(block_hash, [1]) is None and pool.block_hash(block) is None
