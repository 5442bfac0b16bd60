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
