"""KVCacheManager: block tables, prefix hits (exact block ids), all-or-nothing allocation."""

from __future__ import annotations

from sits.kvcache.kv_manager import KVCacheManager

BLOCK_SIZE = 4


def compute(manager: KVCacheManager, request, num_tokens: int) -> None:
    """Allocate and 'compute' the request's next `num_tokens` tokens, then cache them."""
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request, request.num_computed_tokens)


def admit(manager: KVCacheManager, request) -> int:
    """Admit a new request with its prefix hits and compute the rest; returns cached tokens."""
    hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit.num_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request, request.num_computed_tokens)
    return hit.num_tokens


def lookup(manager: KVCacheManager, request) -> tuple[list[int], int]:
    """(device hit block ids, cached tokens) of a device-only manager's lookup."""
    hit = manager.get_computed_blocks(request)
    assert hit.host_block_ids == ()
    return list(hit.block_ids), hit.num_tokens


def test_table_grows_one_block_at_each_boundary(make_request) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(10)))
    compute(manager, request, 10)
    assert manager.get_block_ids("a") == [1, 2, 3]
    for token in (10, 11):  # decode tokens 11 and 12 fit in block 3
        request.append_output_token(token)
        compute(manager, request, 1)
    assert manager.get_block_ids("a") == [1, 2, 3]
    request.append_output_token(12)
    compute(manager, request, 1)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    assert manager.num_free_blocks == 1 and manager.usage == 0.8


def test_sharing_reference_counts_and_all_free_at_end(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(10)))
    assert admit(manager, first) == 0
    assert manager.get_block_ids("a") == [1, 2, 3]
    second = make_request("b", list(range(10)) + [50, 51])
    assert admit(manager, second) == 8
    assert manager.get_block_ids("b") == [1, 2, 4]
    pool = manager.pool
    assert [pool.ref_count(b) for b in (1, 2, 3, 4)] == [2, 2, 1, 1]
    manager.free(first)
    assert [pool.ref_count(b) for b in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert manager.num_free_blocks == 4
    manager.free(second)
    manager.free(second)  # idempotent
    assert manager.num_free_blocks == 7 and manager.usage == 0.0
    # Tables are freed last block first: a's [3], then b's [4, 2, 1].
    assert pool.free_block_ids() == [5, 6, 7, 3, 4, 2, 1]


def test_hit_exactly_at_a_block_boundary(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(12))))
    longer = make_request("b", list(range(12)) + [99])
    assert lookup(manager, longer) == ([1, 2, 3], 12)


def test_never_the_whole_prompt(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(12))))
    same = make_request("b", list(range(12)))
    assert lookup(manager, same) == ([1, 2], 8)
    one_block = make_request("c", list(range(4)))
    assert lookup(manager, one_block) == ([], 0)
    five = make_request("d", list(range(5)))
    assert lookup(manager, five) == ([1], 4)


def test_lookup_skipped_for_prompt_logprobs_salt_and_disabled(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(9)), cache_salt="tenant-1"))
    assert lookup(manager, make_request("b", list(range(9)), "tenant-1")) == (
        [1, 2],
        8,
    )
    assert lookup(manager, make_request("c", list(range(9)), "tenant-2")) == ([], 0)
    assert lookup(manager, make_request("d", list(range(9)))) == ([], 0)
    with_logprobs = make_request("e", list(range(9)), "tenant-1", prompt_logprobs=1)
    assert lookup(manager, with_logprobs) == ([], 0)

    disabled = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    admit(disabled, make_request("a", list(range(9))))
    assert disabled.pool.block_hash(1) is None
    assert lookup(disabled, make_request("b", list(range(9)))) == ([], 0)


def test_only_computed_full_blocks_are_cached(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12)
    assert manager.get_block_ids("a") == [1, 2, 3]
    other = make_request("b", list(range(12)) + [7])
    assert lookup(manager, other) == ([], 0)  # allocated but not computed yet
    request.num_computed_tokens = 7
    manager.cache_full_blocks(request, 7)
    assert lookup(manager, other) == ([1], 4)
    request.num_computed_tokens = 12
    manager.cache_full_blocks(request, 12)
    assert lookup(manager, other) == ([1, 2, 3], 12)


def test_lru_eviction_with_exact_block_ids(make_request) -> None:
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # usable blocks 1..4
    first = make_request("a", list(range(8)))
    admit(manager, first)
    assert manager.get_block_ids("a") == [1, 2]
    manager.free(first)
    assert manager.pool.free_block_ids() == [3, 4, 2, 1]
    # Fresh tokens take the three least recently freed blocks: 3, 4 and a's last block 2.
    filler = make_request("b", [100 + i for i in range(12)])
    admit(manager, filler)
    assert manager.get_block_ids("b") == [3, 4, 2]
    # a's first block (1) survived; its second block was evicted, so the hit stops there.
    again = make_request("c", list(range(8)) + [8])
    assert lookup(manager, again) == ([1], 4)


def test_allocation_is_all_or_nothing_counting_free_hits(make_request) -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)  # usable blocks 1..3
    first = make_request("a", list(range(8)))
    admit(manager, first)
    manager.free(first)  # blocks 1, 2 are cached and free; 3 is free
    hog = make_request("h", [200, 201])
    assert manager.allocate_slots(hog, 2)
    assert manager.get_block_ids("h") == [3]
    # Hitting blocks 1 and 2 takes them out of the free queue: nothing is left for the tail.
    second = make_request("b", list(range(8)) + [8, 9])
    hit = manager.get_computed_blocks(second)
    assert (hit.block_ids, hit.num_tokens) == ((1, 2), 8)
    assert manager.num_blocks_to_take(second, 2, hit) == 3
    assert not manager.allocate_slots(second, 2, hit)
    assert manager.get_block_ids("b") == []
    assert manager.num_free_blocks == 2 and manager.pool.ref_count(1) == 0
    manager.free(hog)
    assert manager.allocate_slots(second, 2, hit)
    assert manager.get_block_ids("b") == [1, 2, 3]


def test_preempted_request_rehits_its_own_output_blocks(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    compute(manager, request, 6)
    for token in (7, 8, 9):
        request.append_output_token(token)
        compute(manager, request, 1)
    request.append_output_token(10)  # sampled, not computed: 10 tokens, 9 computed
    assert manager.get_block_ids("a") == [1, 2, 3]
    manager.free(request)
    request.num_computed_tokens = 0
    assert lookup(manager, request) == ([1, 2], 8)


def test_prefix_cache_stats_count_admissions(make_request) -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(manager, make_request("a", list(range(10))))
    admit(manager, make_request("b", list(range(10))))
    admit(manager, make_request("c", list(range(10)), prompt_logprobs=0))  # not a query
    stats = manager.stats
    assert (stats.num_requests, stats.num_query_tokens, stats.num_hit_tokens) == (2, 20, 8)
    assert stats.hit_rate == 0.4
