"""Routing policy: load scores, prefix keys, rendezvous ranking and the choice, exactly."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from sits.admission import FakeClock
from sits.core.errors import InvalidParameterError
from sits.core.fleet import Heartbeat, ReplicaLoad
from sits.router.policy import (
    RouteChoice,
    RouteReason,
    choose,
    load_score,
    prefix_key,
    rendezvous_rank,
)
from sits.router.registry import Registry, Replica

A, B, C = "http://a:8001", "http://b:8002", "http://c:8003"
URLS = [A, B, C]


def _replicas(**loads: ReplicaLoad) -> list[Replica]:
    """Replicas a, b, c (capacity 4) with the given loads by name, idle otherwise."""
    registry = Registry(FakeClock())
    for url in URLS:
        load = loads.get(url.split("//")[1][0], ReplicaLoad())
        registry.heartbeat(Heartbeat(url=url, models=("m",), capacity=4, load=load))
    return registry.candidates("m")


def _by_url(replicas: list[Replica]) -> dict[str, Replica]:
    return {r.url: r for r in replicas}


def test_load_score_formula() -> None:
    idle, busy, yellow, red = (
        _replicas(
            b=ReplicaLoad(num_running=2, num_waiting=3, kv_cache_usage=0.5),
            c=ReplicaLoad(num_running=4, overload_state="yellow"),
        )
        + _replicas(a=ReplicaLoad(kv_cache_usage=0.25, overload_state="red"))[:1]
    )
    assert load_score(idle) == 0.0
    assert load_score(busy) == 3 + 2 + 0.5
    assert load_score(yellow) == 4 + 0.25 * 4
    assert load_score(red) == 0.25 + 1.0 * 4
    busy.inflight = 2  # the router's own requests, already in the heartbeat's running
    assert load_score(busy) == 3 + 2 + 0.5
    busy.inflight = 5  # more than the last heartbeat knew of: the fresher count wins
    assert load_score(busy) == 3 + 5 + 0.5


def test_prefix_key_hashes_whole_blocks_per_tenant() -> None:
    assert prefix_key("t", "x" * 255) is None
    one = prefix_key("t", "x" * 256)
    assert one == hashlib.sha256(b"\0\0\0\1t" + b"x" * 256).digest()
    assert prefix_key("t", "x" * 511) == one  # only whole blocks count
    text = "".join(chr(ord("a") + i % 26) for i in range(2000))
    key = prefix_key("t", text)
    assert key == prefix_key("t", text[:1024] + "another tail")  # at most 4 blocks
    assert key != prefix_key("t", text[:1023] + "!" + text[1024:])
    assert key != prefix_key("u", text)  # per tenant
    assert prefix_key("ab", "c" * 256) != prefix_key("a", "bc" * 128)  # tenant is delimited
    assert prefix_key("t", "x" * 20, block_chars=10, max_blocks=1) == prefix_key("t", "x" * 10, 10)
    assert len(key) == 32


@pytest.mark.parametrize(
    ("kwargs", "param"), [({"block_chars": 0}, "block_chars"), ({"max_blocks": 0}, "max_blocks")]
)
def test_prefix_key_rejects_bad_sizes(kwargs: dict[str, int], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        prefix_key("t", "x" * 1000, **kwargs)
    assert err.value.param == param


def test_rendezvous_rank_is_highest_random_weight() -> None:
    key = b"some key"
    scores = {u: int.from_bytes(hashlib.sha256(key + u.encode()).digest()[:8], "big") for u in URLS}
    expected = sorted(URLS, key=lambda u: -scores[u])
    assert rendezvous_rank(key, URLS) == expected
    assert rendezvous_rank(key, reversed(URLS)) == expected  # input order does not matter
    assert rendezvous_rank(key, [*URLS, A]) == expected  # duplicates dropped
    assert rendezvous_rank(key, []) == []


def test_rendezvous_moves_only_the_keys_of_a_removed_url() -> None:
    keys = [f"key {i}".encode() for i in range(300)]
    first = {k: rendezvous_rank(k, URLS)[0] for k in keys}
    spread = Counter(first.values())
    assert set(spread) == set(URLS)
    assert min(spread.values()) >= 70  # 300 keys over 3 urls: about 100 each
    for k in keys:
        after = rendezvous_rank(k, [A, C])[0]
        assert after == first[k] if first[k] != B else after == rendezvous_rank(k, URLS)[1]


def test_affinity_is_stable_for_a_key() -> None:
    replicas = _replicas()
    key = prefix_key("tenant", "system prompt " * 100)
    choice = choose(replicas, key, load_bound=2.0)
    assert choice == RouteChoice(rendezvous_rank(key, URLS)[0], RouteReason.PREFIX_AFFINITY)
    for _ in range(5):
        assert choose(replicas, key, load_bound=2.0) == choice
    assert choose(list(reversed(replicas)), key, load_bound=2.0) == choice


def test_many_keys_spread_over_three_replicas() -> None:
    replicas = _replicas()
    picks = Counter(choose(replicas, f"prompt {i}".encode(), 1.0).url for i in range(300))
    assert set(picks) == set(URLS)
    assert min(picks.values()) >= 70


def test_load_bound_sends_an_overloaded_affine_replica_s_keys_elsewhere() -> None:
    key = b"k"
    first, second, third = rendezvous_rank(key, URLS)
    replicas = _replicas()
    by_url = _by_url(replicas)
    by_url[first].load = ReplicaLoad(num_waiting=2)  # score 2.0 against 0.0
    assert choose(replicas, key, load_bound=2.0) == RouteChoice(first, RouteReason.PREFIX_AFFINITY)
    by_url[first].inflight = 1  # score 2.25: over the bound
    # least loaded, ties in the key's rendezvous order: its second replica
    assert choose(replicas, key, load_bound=2.0) == RouteChoice(second, RouteReason.LOAD_BOUND)
    by_url[second].load = ReplicaLoad(kv_cache_usage=0.5)
    assert choose(replicas, key, load_bound=2.0) == RouteChoice(third, RouteReason.LOAD_BOUND)
    assert choose(replicas, key, load_bound=0.0) == RouteChoice(third, RouteReason.LOAD_BOUND)


def test_zero_load_bound_keeps_affinity_while_loads_tie() -> None:
    replicas = _replicas()
    key = b"k"
    assert choose(replicas, key, load_bound=0.0).reason is RouteReason.PREFIX_AFFINITY


def test_without_a_key_the_least_loaded_wins_ties_by_url() -> None:
    replicas = _replicas()
    assert choose(replicas, None, load_bound=1.0) == RouteChoice(A, RouteReason.LEAST_LOADED)
    by_url = _by_url(replicas)
    by_url[A].inflight = 1
    assert choose(replicas, None, 1.0) == RouteChoice(B, RouteReason.LEAST_LOADED)
    by_url[B].inflight = 1
    assert choose(replicas, None, 1.0) == RouteChoice(C, RouteReason.LEAST_LOADED)
    by_url[C].load = ReplicaLoad(overload_state="yellow")
    assert choose(replicas, None, 1.0) == RouteChoice(A, RouteReason.LEAST_LOADED)


def test_a_tiebreak_spreads_equally_idle_replicas_and_keeps_the_load_rule() -> None:
    replicas = _replicas()
    picks = [choose(replicas, None, 1.0, tiebreak=bytes([i])) for i in range(30)]
    assert {p.reason for p in picks} == {RouteReason.LEAST_LOADED}
    assert [p.url for p in picks] == [rendezvous_rank(bytes([i]), URLS)[0] for i in range(30)]
    assert {p.url for p in picks} == set(URLS)
    by_url = _by_url(replicas)
    by_url[A].inflight = by_url[B].inflight = 1
    assert {choose(replicas, None, 1.0, tiebreak=bytes([i])).url for i in range(30)} == {C}


def test_exclude_and_the_only_candidate() -> None:
    replicas = _replicas()
    key = b"k"
    first, second, _ = rendezvous_rank(key, URLS)
    assert choose(replicas, key, 1.0, exclude={first}) == RouteChoice(
        second, RouteReason.PREFIX_AFFINITY
    )
    assert choose(replicas, None, 1.0, exclude=(A, B)) == RouteChoice(C, RouteReason.ONLY)
    assert choose(replicas, key, 1.0, exclude=URLS) is None
    assert choose([], None, 1.0) is None


def test_choose_rejects_a_negative_load_bound() -> None:
    with pytest.raises(InvalidParameterError) as err:
        choose(_replicas(), None, load_bound=-0.5)
    assert err.value.param == "load_bound"


def test_route_reason_values() -> None:
    assert [str(r) for r in RouteReason] == [
        "prefix_affinity",
        "least_loaded",
        "affinity_over_load_bound",
        "fallback",
        "canary",
        "only_candidate",
    ]
