"""KVCacheManager with a host tier: evicted prefix blocks go to host blocks, a device miss that
hits the host gets a new device block and a planned copy (exact block ids and copies)."""

from __future__ import annotations

from sits.kvcache import (
    NO_DEVICE_BLOCK,
    HostBlockPool,
    HostPrefixTier,
    KVCacheManager,
    SwapStats,
    hash_full_blocks,
)

BLOCK_SIZE = 4
BLOCK_BYTES = 100


def make_manager(num_blocks: int, num_host_blocks: int) -> KVCacheManager:
    tier = HostPrefixTier(HostBlockPool(num_host_blocks), SwapStats(), BLOCK_BYTES)
    return KVCacheManager(num_blocks, BLOCK_SIZE, host_tier=tier)


def admit(manager: KVCacheManager, request) -> None:
    """Admit with prefix hits, compute every token, register the full blocks."""
    hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request, request.num_tokens)


def test_evicted_block_goes_to_host_and_a_host_hit_copies_it_back(make_request) -> None:
    manager = make_manager(num_blocks=5, num_host_blocks=3)  # device blocks 1..4
    tier = manager.host_tier
    a = make_request("a", list(range(9)))
    admit(manager, a)
    assert manager.get_block_ids("a") == [1, 2, 3]  # 1, 2 full and cached
    manager.free(a)
    assert manager.pool.free_block_ids() == [4, 3, 2, 1]
    assert tier.take_copies() == ([], [])
    # b takes 4, 3, 2: block 2 (a's tokens 4..7) is evicted and copied to host block 0.
    b = make_request("b", [100 + i for i in range(12)])
    admit(manager, b)
    assert manager.get_block_ids("b") == [4, 3, 2]
    assert tier.take_copies() == ([(2, 0)], [])
    manager.free(b)
    tier.host.begin_step()
    # c shares a's 8 tokens: block 0 is still on the device (1), block 1 only on the host (0).
    c = make_request("c", list(range(9)) + [50])
    hit = manager.get_computed_blocks(c)
    assert (hit.block_ids, hit.host_block_ids, hit.num_tokens) == ((1, NO_DEVICE_BLOCK), (0,), 8)
    # 1 new block + 1 for the host block + the free device hit 1.
    assert manager.num_blocks_to_take(c, 2, hit) == 3
    assert manager.allocate_slots(c, 2, hit)
    # Allocating 2 and 3 evicts b's blocks 2 and 3 to host blocks 1 and 2 (host block 0 is
    # pinned by the hit); block 2 then receives host block 0 (out before in, in one step).
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert tier.take_copies() == ([(2, 1), (3, 2)], [(0, 2)])
    hashes = hash_full_blocks(c.all_token_ids, BLOCK_SIZE, None)
    assert manager.pool.block_hash(2) == hashes[1]  # registered at once
    # A second request of the same step shares device block 2 instead of copying again.
    d = make_request("d", list(range(8)) + [60, 61])
    hit = manager.get_computed_blocks(d)
    assert (hit.block_ids, hit.host_block_ids) == ((1, 2), ())
    stats = tier.stats
    assert stats.num_host_hit_tokens == 4 and manager.stats.num_hit_tokens == 4
    assert (stats.num_host_stored_blocks, stats.num_host_loaded_blocks) == (3, 1)
    assert stats.num_host_cache_bytes == 4 * BLOCK_BYTES
    assert (stats.num_swap_out_blocks, stats.num_swapped_bytes) == (0, 0)
    c.num_computed_tokens = 8  # the hit
    manager.free(c)
    assert manager.num_free_blocks == 4 and tier.host.num_free_blocks == 3


def test_full_host_tier_replaces_its_least_recently_used_block(make_request) -> None:
    manager = make_manager(num_blocks=4, num_host_blocks=1)  # device blocks 1..3
    tier = manager.host_tier
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)  # free queue [3, 2, 1]; 1, 2 cached
    b = make_request("b", [100 + i for i in range(5)])
    admit(manager, b)  # takes 3, 2: a's second block (2) -> host 0
    assert tier.take_copies() == ([(2, 0)], [])
    manager.free(b)  # free queue [1, 2, 3]; 1 (a's first block) and 3 (b's) cached
    tier.host.begin_step()
    c = make_request("c", [200 + i for i in range(5)])
    assert manager.allocate_slots(c, 5, manager.get_computed_blocks(c))
    # Evicting device block 1 (a's first block) replaces a's second block on the host.
    assert manager.get_block_ids("c") == [1, 2]
    assert tier.take_copies() == ([(1, 0)], [])
    manager.free(c)
    tier.host.begin_step()
    again = make_request("e", list(range(9)) + [1])
    hit = manager.get_computed_blocks(again)
    assert (hit.block_ids, hit.host_block_ids, hit.num_tokens) == ((NO_DEVICE_BLOCK,), (0,), 4)
    assert tier.stats.num_host_stored_blocks == 2


def test_a_host_hit_keeps_its_host_block_when_allocation_needs_room(make_request) -> None:
    manager = make_manager(num_blocks=4, num_host_blocks=1)  # device blocks 1..3
    tier = manager.host_tier
    a = make_request("a", list(range(4)) + [9])
    admit(manager, a)  # [1, 2]; block 1 cached
    manager.free(a)  # free queue [3, 2, 1]
    b = make_request("b", [100 + i for i in range(12)])
    admit(manager, b)  # takes 3, 2, 1: a's block 1 -> host 0
    assert tier.take_copies() == ([(1, 0)], [])
    manager.free(b)  # free queue [1, 2, 3], all three cached (b's)
    tier.host.begin_step()
    c = make_request("c", list(range(4)) + [9, 8, 7, 6, 5])
    hit = manager.get_computed_blocks(c)
    assert (hit.block_ids, hit.host_block_ids) == ((NO_DEVICE_BLOCK,), (0,))
    assert manager.allocate_slots(c, 5, hit)
    # Blocks 1, 2, 3 are evicted; their offloads would need host block 0, which the hit pins.
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert tier.take_copies() == ([], [(0, 1)])
    assert tier.host.lookup(hit_hash(c, 0), list(range(4))) == 0


def hit_hash(request, block_idx: int) -> bytes:
    return hash_full_blocks(request.all_token_ids, BLOCK_SIZE, request.cache_salt)[block_idx]


def test_host_tier_respects_salt_and_reset(make_request) -> None:
    manager = make_manager(num_blocks=3, num_host_blocks=4)  # device blocks 1, 2
    tier = manager.host_tier
    a = make_request("a", list(range(5)), cache_salt="t1")
    admit(manager, a)
    manager.free(a)
    b = make_request("b", [100 + i for i in range(8)])
    admit(manager, b)
    assert tier.take_copies() == ([(1, 0)], [])
    manager.free(b)
    other_tenant = make_request("c", list(range(5)), cache_salt="t2")
    assert manager.get_computed_blocks(other_tenant).num_tokens == 0
    same_tenant = make_request("d", list(range(5)), cache_salt="t1")
    assert manager.get_computed_blocks(same_tenant).host_block_ids == (0,)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(same_tenant).num_tokens == 0
    assert tier.host.num_cached_blocks == 0


def test_no_host_tier_without_prefix_caching(make_request) -> None:
    tier = HostPrefixTier(HostBlockPool(4), SwapStats(), BLOCK_BYTES)
    manager = KVCacheManager(3, BLOCK_SIZE, enable_prefix_caching=False, host_tier=tier)
    assert manager.host_tier is None
    a = make_request("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    admit(manager, make_request("b", [100 + i for i in range(8)]))
    assert tier.take_copies() == ([], []) and tier.host.num_cached_blocks == 0
