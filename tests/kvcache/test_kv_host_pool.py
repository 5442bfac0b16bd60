"""`HostBlockPool`: exact host block ids, lowest first, and free accounting."""

from __future__ import annotations

import pytest

from sits.kvcache import HostBlockPool


def test_allocates_lowest_free_ids_and_reuses_freed_ones() -> None:
    pool = HostBlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 5)
    pool.free([3, 1])
    assert pool.allocate(2) == [1, 3]
    pool.free([0, 1, 2, 3, 4])
    assert pool.num_free_blocks == 6 and pool.allocate(6) == [0, 1, 2, 3, 4, 5]


def test_errors_and_empty_tier() -> None:
    pool = HostBlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    assert HostBlockPool(0).num_free_blocks == 0
    with pytest.raises(ValueError):
        HostBlockPool(-1)


def h(i: int) -> bytes:
    """A distinct fake block hash."""
    return bytes([i]) * 32


def test_prefix_blocks_take_lowest_free_then_lru_and_pins_last_a_step() -> None:
    pool = HostBlockPool(3)
    assert [pool.store(h(i), [i]) for i in range(3)] == [0, 1, 2]
    assert pool.cached_block_ids() == [0, 1, 2] and pool.num_free_blocks == 3
    # Everything was written this step: nothing can be evicted until the next one.
    assert pool.num_allocatable_blocks == 0 and pool.store(h(3), [3]) is None
    pool.begin_step()
    assert pool.store(h(1), [1]) is None  # already cached: no copy, becomes most recent
    assert pool.cached_block_ids() == [0, 2, 1]
    assert pool.lookup(h(0), [0]) == 0
    assert pool.lookup(h(0), [9]) is None  # same hash, other tokens: a collision, no hit
    pool.read([0])  # a hit: pinned and most recently used
    assert pool.cached_block_ids() == [2, 1, 0]
    assert pool.store(h(3), [3]) == 2  # evicts the LRU block 2 (hash 2 is gone)
    assert pool.lookup(h(2), [2]) is None and pool.lookup(h(3), [3]) == 2
    assert pool.store(h(4), [4]) == 1
    assert pool.store(h(5), [5]) is None  # 0 is read and 1, 2 written this step
    pool.begin_step()
    assert pool.cached_block_ids() == [0, 2, 1] and pool.store(h(5), [5]) == 0
    assert pool.lookup(h(0), [0]) is None


def test_swapped_requests_take_precedence_over_cached_blocks() -> None:
    pool = HostBlockPool(5)
    assert pool.allocate(2) == [0, 1]  # held by a swapped-out request
    assert [pool.store(h(i), [i]) for i in range(3)] == [2, 3, 4]
    pool.begin_step()
    pool.read([3])  # block 3 (hash 1) is hit this step
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_allocatable_blocks) == (3, 2, 2)
    # A swap-out takes the LRU unpinned cached blocks 2 and 4; the cache keeps the hit block 3.
    assert pool.allocate(2) == [2, 4]
    assert pool.cached_block_ids() == [3] and pool.lookup(h(1), [1]) == 3
    assert pool.lookup(h(0), [0]) is None and pool.lookup(h(2), [2]) is None
    with pytest.raises(ValueError):
        pool.allocate(1)  # 3 is pinned
    assert pool.store(h(7), [7]) is None  # a prefix block never takes a held block
    pool.begin_step()
    assert pool.allocate(1) == [3] and pool.num_cached_blocks == 0
    assert pool.store(h(8), [8]) is None  # all five held now
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 5


def test_blocks_freed_while_read_return_at_the_next_step() -> None:
    pool = HostBlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.begin_step()
    pool.read([0, 1])  # swapped back in this step
    pool.free([0, 1])
    assert pool.num_free_blocks == 2 and pool.num_allocatable_blocks == 2
    assert pool.allocate(2) == [2, 3]  # not 0, 1: this step's swap-ins still read them
    pool.free([2, 3])  # not pinned (an abort between steps): free at once
    assert pool.num_free_blocks == 2
    pool.begin_step()
    assert pool.num_free_blocks == 4 and pool.store(h(1), [1]) == 0


def test_reset_cache_keeps_held_blocks() -> None:
    pool = HostBlockPool(4)
    assert pool.allocate(1) == [0]
    assert [pool.store(h(i), [i]) for i in range(2)] == [1, 2]
    pool.reset_cache()  # written this step: free from the next step on
    assert pool.num_cached_blocks == 0 and pool.lookup(h(0), [0]) is None
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 1
    pool.begin_step()
    assert pool.num_free_blocks == 3 and pool.allocate(3) == [1, 2, 3]
