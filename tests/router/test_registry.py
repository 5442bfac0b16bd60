"""The replica registry: heartbeats, expiry, probes, draining and breakers, with a fake clock."""

from __future__ import annotations

import pytest

from sits.admission import BreakerConfig, BreakerState, FakeClock
from sits.core.errors import InvalidParameterError
from sits.core.fleet import Heartbeat, ReplicaLoad
from sits.router.registry import Registry, ReplicaStatus

HEALTHY, DOWN, DRAINING = ReplicaStatus.HEALTHY, ReplicaStatus.DOWN, ReplicaStatus.DRAINING
A, B, C = "http://a:8001", "http://b:8002", "http://c:8003"


def _hb(url: str = A, models: tuple[str, ...] = ("m",), **load: object) -> Heartbeat:
    load_ = ReplicaLoad(**load)
    return Heartbeat(url=url, models=models, capacity=8, max_model_len=4096, load=load_)


def _registry(**kwargs: object) -> tuple[Registry, FakeClock]:
    clock = FakeClock()
    return Registry(clock, **kwargs), clock


def test_heartbeat_registers_and_refreshes() -> None:
    registry, clock = _registry()
    replica = registry.heartbeat(_hb(A + "/", num_running=2))
    assert replica.url == A  # normalized
    assert (replica.status, replica.static, replica.pool) == (HEALTHY, False, "primary")
    assert (replica.capacity, replica.max_model_len, replica.load.num_running) == (8, 4096, 2)
    assert replica.last_heartbeat_s == 0.0
    clock.set(2.0)
    again = registry.heartbeat(_hb(A, models=("m", "n"), num_running=5), pool="fallback")
    assert again is replica
    assert (replica.models, replica.load.num_running, replica.last_heartbeat_s) == (
        ("m", "n"),
        5,
        2.0,
    )
    assert replica.pool == "primary"  # a known replica keeps its pool
    assert registry.get(A + "/") is replica
    assert [r.url for r in registry.all()] == [A]


def test_expiry_after_exactly_three_intervals() -> None:
    registry, clock = _registry()
    registry.heartbeat(_hb(A))
    registry.heartbeat(_hb(B))
    assert registry.heartbeat_timeout_s == 6.0
    clock.set(2.0)
    registry.heartbeat(_hb(B))
    clock.set(5.75)
    assert registry.expire() == []
    assert [r.url for r in registry.candidates("m")] == [A, B]
    clock.set(6.0)  # A's last heartbeat is exactly 3 x 2 s old
    assert registry.expire() == [A]
    assert registry.expire() == []  # only newly taken out
    assert registry.get(A).status is DOWN
    assert [r.url for r in registry.candidates("m")] == [B]
    clock.set(8.0)
    assert [r.url for r in registry.candidates("m")] == []  # candidates expire B themselves
    assert registry.get(B).status is DOWN
    registry.heartbeat(_hb(A))  # a heartbeat brings it back
    assert registry.get(A).status is HEALTHY
    assert registry.counts() == {HEALTHY: 1, DOWN: 1, DRAINING: 0}


def test_custom_interval_and_missed_count() -> None:
    registry, clock = _registry(heartbeat_interval_s=0.5, missed_heartbeats=2)
    registry.heartbeat(_hb(A))
    clock.set(0.75)
    assert registry.expire() == []
    clock.set(1.0)
    assert registry.expire() == [A]


def test_static_replicas_never_expire_and_follow_probes() -> None:
    registry, clock = _registry()
    replica = registry.add_static(A + "/", pool="fallback")
    assert (replica.url, replica.static, replica.pool, replica.status) == (
        A,
        True,
        "fallback",
        HEALTHY,
    )
    assert replica.last_heartbeat_s is None
    assert registry.candidates("m", pool="fallback") == [replica]  # models unknown: any
    assert registry.candidates(None, pool="fallback") == [replica]
    assert registry.set_models(A, ["m"], max_model_len=2048) is True
    assert registry.set_models(B, ["m"]) is False
    assert (replica.models, replica.max_model_len) == (("m",), 2048)
    assert registry.candidates("m", pool="fallback") == [replica]
    assert registry.candidates("m", pool="primary") == []
    clock.set(1000.0)
    assert registry.expire() == []
    assert registry.record_probe(A, ok=False) is DOWN
    assert replica.probe_ok is False
    assert registry.candidates("m", pool="fallback") == []
    assert registry.record_probe(A, ok=True) is HEALTHY
    assert replica.probe_ok is True
    assert registry.record_probe(B, ok=True) is None


def test_an_ok_probe_brings_back_a_registered_replica_only_with_a_fresh_heartbeat() -> None:
    registry, clock = _registry()
    registry.heartbeat(_hb(A))
    clock.set(1.0)
    assert registry.record_probe(A, ok=False) is DOWN
    clock.set(5.5)
    assert registry.record_probe(A, ok=True) is HEALTHY  # last heartbeat 5.5 s old: fresh
    assert registry.record_probe(A, ok=False) is DOWN
    clock.set(6.0)
    assert registry.record_probe(A, ok=True) is DOWN  # 6 s old: stale
    registry.heartbeat(_hb(A))
    assert registry.get(A).status is HEALTHY


def test_a_heartbeat_brings_back_a_replica_down_after_a_failed_probe() -> None:
    registry, _ = _registry()
    registry.heartbeat(_hb(A))
    registry.record_probe(A, ok=False)
    assert registry.heartbeat(_hb(A)).status is HEALTHY


def test_draining_by_heartbeat_and_by_the_proxy() -> None:
    registry, _ = _registry()
    assert registry.heartbeat(_hb(A, draining=True)).status is DRAINING
    assert registry.candidates("m") == []
    assert registry.models() == []
    assert registry.heartbeat(_hb(A)).status is HEALTHY
    assert registry.mark_draining(A + "/") is True
    assert registry.get(A).status is DRAINING
    assert registry.candidates("m") == []
    assert registry.record_probe(A, ok=True) is DRAINING  # a registered one waits for a beat
    assert registry.heartbeat(_hb(A)).status is HEALTHY
    assert registry.mark_draining(B) is False
    registry.record_probe(A, ok=False)
    assert registry.mark_draining(A) is True
    assert registry.get(A).status is DOWN  # a DOWN replica stays DOWN


def test_a_draining_static_replica_returns_on_an_ok_probe() -> None:
    registry, _ = _registry()
    registry.add_static(A)
    registry.mark_draining(A)
    assert registry.get(A).status is DRAINING
    assert registry.record_probe(A, ok=True) is HEALTHY


def test_deregister_forgets_registered_and_downs_static() -> None:
    registry, _ = _registry()
    registry.heartbeat(_hb(A))
    registry.add_static(B)
    assert registry.deregister(A + "/") is True
    assert registry.get(A) is None
    assert registry.deregister(A) is False
    assert registry.deregister(B) is True
    assert registry.get(B).status is DOWN
    assert registry.record_probe(B, ok=True) is HEALTHY


def test_static_replica_keeps_flags_over_heartbeats() -> None:
    registry, clock = _registry()
    registry.add_static(A, pool="fallback", version_label="canary")
    clock.set(1.0)
    replica = registry.heartbeat(_hb(A, num_waiting=3), pool="primary")
    assert (replica.pool, replica.version_label, replica.static) == ("fallback", "canary", True)
    assert replica.is_canary is True
    assert (replica.models, replica.load.num_waiting, replica.last_heartbeat_s) == (("m",), 3, 1.0)
    clock.set(100.0)
    assert registry.expire() == []  # static: never expired


def test_registered_version_label_follows_heartbeats() -> None:
    registry, _ = _registry()
    hb = Heartbeat(url=A, models=("m",), version_label="canary")
    assert registry.heartbeat(hb).is_canary is True
    assert registry.heartbeat(_hb(A)).version_label == "stable"


def test_candidates_filter_model_pool_label_and_sort_by_url() -> None:
    registry, _ = _registry()
    registry.heartbeat(_hb(C, models=("m", "n")))
    registry.heartbeat(_hb(A, models=("m",)))
    registry.heartbeat(Heartbeat(url=B, models=("n",), version_label="canary"))
    registry.heartbeat(_hb("http://d:1", models=("x",)), pool="fallback")
    assert [r.url for r in registry.candidates("m")] == [A, C]
    assert [r.url for r in registry.candidates("n")] == [B, C]
    assert [r.url for r in registry.candidates(None)] == [A, B, C]
    assert [r.url for r in registry.candidates("n", version_label="canary")] == [B]
    assert [r.url for r in registry.candidates("x", pool="fallback")] == ["http://d:1"]
    assert registry.candidates("zzz") == []
    assert registry.models() == ["m", "n", "x"]
    with pytest.raises(InvalidParameterError) as err:
        registry.candidates("m", pool="other")
    assert err.value.param == "pool"


def test_candidates_follow_breaker_state_without_using_the_probe() -> None:
    config = BreakerConfig(max_consecutive_failures=2, open_s=10.0)
    registry, clock = _registry(breaker_config=config)
    registry.add_static(A, models=["m"])
    registry.add_static(B, models=["m"])
    breaker = registry.get(A).breaker
    assert breaker.config is config
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    assert [r.url for r in registry.candidates("m")] == [B]
    clock.set(10.0)
    assert breaker.state is BreakerState.HALF_OPEN
    for _ in range(3):  # listing never consumes the half-open probe
        assert [r.url for r in registry.candidates("m")] == [A, B]
    assert breaker.allow().is_probe is True
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED
    assert registry.get(B).breaker is not breaker  # one breaker per replica


def test_observed_ttft_window_uses_the_registry_clock() -> None:
    registry, clock = _registry(ttft_window_s=5.0)
    replica = registry.add_static(A)
    replica.observed_ttft.add(0.3)
    clock.set(5.0)
    assert replica.observed_ttft.count() == 0


def test_snapshot_and_counts() -> None:
    registry, clock = _registry()
    registry.heartbeat(_hb(A))
    registry.add_static(B, models=["m"])
    registry.mark_draining(B)
    clock.set(1.5)
    snap = registry.snapshot()
    assert [s["url"] for s in snap] == [A, B]
    assert snap[0]["heartbeat_age_s"] == 1.5
    assert snap[1]["heartbeat_age_s"] is None
    assert snap[1]["status"] == "draining"
    assert (snap[1]["breaker"], snap[1]["static"]) == ("closed", True)
    assert registry.counts() == {HEALTHY: 1, DOWN: 0, DRAINING: 1}


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"heartbeat_interval_s": 0.0}, "heartbeat_interval_s"),
        ({"missed_heartbeats": 0}, "missed_heartbeats"),
        ({"ttft_window_s": -1.0}, "ttft_window_s"),
    ],
)
def test_invalid_registry_settings(kwargs: dict[str, float], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        Registry(FakeClock(), **kwargs)
    assert err.value.param == param


def test_invalid_static_replicas() -> None:
    registry, _ = _registry()
    registry.add_static(A)
    cases = [
        ((A + "/",), {}, "url"),  # given twice
        (("ftp://x",), {}, "url"),
        ((B,), {"pool": "zone2"}, "pool"),
        ((B,), {"version_label": ""}, "version_label"),
    ]
    for args, kwargs, param in cases:
        with pytest.raises(InvalidParameterError) as err:
            registry.add_static(*args, **kwargs)
        assert err.value.param == param
    with pytest.raises(InvalidParameterError) as err:
        registry.heartbeat(_hb(B), pool="zone2")
    assert err.value.param == "pool"


def test_a_restarted_replica_rejoins_with_a_closed_breaker() -> None:
    registry, clock = _registry(breaker_config=BreakerConfig(max_consecutive_failures=2))
    replica = registry.heartbeat(_hb(A))
    replica.breaker.record_failure()
    replica.breaker.record_failure()
    assert replica.breaker.state is BreakerState.OPEN
    clock.set(6.0)
    assert registry.expire() == [A]  # killed: its heartbeats stop
    clock.set(7.0)
    back = registry.heartbeat(_hb(A))  # the new process registers
    assert back.status is HEALTHY
    assert back.breaker.state is BreakerState.CLOSED
    assert [r.url for r in registry.candidates("m")] == [A]


def test_a_static_replica_without_known_models_is_tried_for_any_model() -> None:
    registry, _ = _registry()
    registry.add_static(A)
    assert [r.url for r in registry.candidates("anything")] == [A]
    registry.set_models(A, ("m",), 2048)
    assert registry.candidates("anything") == []
    assert [r.url for r in registry.candidates("m")] == [A]
