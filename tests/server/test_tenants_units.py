"""Server QoS pieces without a server: admission order, tickets, overload signals and watcher,
outcome classification, cache salts, settings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from sits.admission import (
    BreakerConfig,
    BreakerState,
    FakeClock,
    OverloadState,
    OverloadThresholds,
)
from sits.core.errors import EngineDeadError, InvalidParameterError, PromptTooLongError
from sits.engine.core import WaitingLoad
from sits.obs.tenant_metrics import TenantMetrics
from sits.server.context import ServerSettings
from sits.server.errors import ServerError, draining_error
from sits.server.qos.admit import Outcome, QosSettings, ServerQos, is_engine_failure, outcome_of
from sits.server.qos.overload_watch import OverloadWatcher, PrefillRateEstimator, overload_signals
from sits.tenancy import TenantsConfig, Tier
from tests.server.tenant_fixtures import tenant

TENANTS = TenantsConfig(
    (
        tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5, ttft_ms=1000),
        tenant("bulk", tier=Tier.BURSTABLE, reserved_kv_fraction=0.2, requests_per_minute=6),
        tenant("free", tier=Tier.BEST_EFFORT, requests_per_minute=6, tokens_per_minute=1000),
    )
)


def _sched(
    used: int, reserved: int, running: int = 0, seqs: int = 4, blocks_borrowed: int = 0
) -> SimpleNamespace:
    return SimpleNamespace(
        blocks_used=used,
        blocks_reserved=reserved,
        num_running=running,
        seqs_reserved=seqs,
        blocks_borrowed=blocks_borrowed,
    )


class FakeEngine:
    """Stats and borrowing tiers only."""

    def __init__(self) -> None:
        self.tiers_set: list[frozenset[str]] = []
        self.snapshot = SimpleNamespace(
            tenants={"gold": _sched(0, 50), "bulk": _sched(0, 20), "free": _sched(0, 0)},
            waiting={},
            kv_cache_usage=0.0,
            num_full_prefill_tokens=0,
            full_prefill_busy_s=0.0,
        )

    def stats(self) -> SimpleNamespace:
        return self.snapshot

    def set_borrowing_tiers(self, tiers) -> None:
        self.tiers_set.append(frozenset(tiers))


def _qos(
    clock: FakeClock, engine: FakeEngine | None = None, tenants: TenantsConfig = TENANTS
) -> ServerQos:
    settings = QosSettings(
        breaker=BreakerConfig(max_consecutive_failures=1, open_s=10), clock=clock
    )
    metrics = TenantMetrics(CollectorRegistry(), "m", tenants)
    return ServerQos(engine or FakeEngine(), tenants, settings, metrics, isolate_prefix_cache=True)


def test_breaker_is_checked_first_and_a_refusal_consumes_nothing() -> None:
    clock = FakeClock()
    qos = _qos(clock)
    ticket = qos.admit(TENANTS.get("free"), 10, 10)
    ticket.finish(Outcome.ERROR, 5)  # one failure opens this breaker
    assert qos.breaker.state is BreakerState.OPEN
    with pytest.raises(ServerError) as err:
        qos.admit(TENANTS.get("free"), 10, 10)
    assert err.value.status == 503 and err.value.code == "circuit_open"
    assert err.value.headers == {"Retry-After": "10", "retry-after-ms": "10000"}
    snapshot = qos.admission.snapshot("free")
    assert snapshot.remaining_requests == 5  # only the first request was charged
    assert snapshot.remaining_tokens == 1000 - 5  # reconciled to its real usage
    clock.advance(10)  # half-open: a probe refused by the rate limit is handed back
    with pytest.raises(ServerError) as err:
        qos.admit(TENANTS.get("free"), 10, 2000)
    assert err.value.status == 400 and err.value.param == "max_tokens"
    probe = qos.admit(TENANTS.get("free"), 10, 10)
    assert probe.is_probe
    probe.finish(Outcome.OK, 20)
    assert qos.breaker.state is BreakerState.CLOSED


def test_red_sheds_by_tier_and_quota_before_rate_limits() -> None:
    engine = FakeEngine()
    qos = _qos(FakeClock(), engine)
    qos.force_overload_state(OverloadState.RED)
    assert engine.tiers_set == [frozenset({"guaranteed"})]
    with pytest.raises(ServerError) as err:
        qos.admit(TENANTS.get("free"), 1, 1)
    assert (err.value.status, err.value.code) == (503, "overloaded")
    assert err.value.headers == {"Retry-After": "5", "retry-after-ms": "5000"}
    assert qos.admission.snapshot("free").remaining_requests == 6  # nothing consumed
    with pytest.raises(ServerError) as err:  # no wait admits it: 400 in any state, not 503
        qos.admit(TENANTS.get("free"), 1000, 200)
    assert (err.value.status, err.value.code, err.value.param) == (
        400,
        "request_too_large",
        "prompt",
    )
    assert "Retry-After" not in err.value.headers
    assert err.value.message.startswith("Request too large: 1000 prompt tokens + 200 for")
    with pytest.raises(ServerError) as err:
        qos.admit(TENANTS.get("free"), 10, 995)
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    qos.admit(TENANTS.get("bulk"), 1, 1).finish(Outcome.OK, 2)  # within its reservation
    engine.snapshot.tenants["bulk"] = _sched(20, 20)  # holds its whole reservation
    with pytest.raises(ServerError):
        qos.admit(TENANTS.get("bulk"), 1, 1)
    engine.snapshot.tenants["gold"] = _sched(10, 50)
    qos.admit(TENANTS.get("gold"), 1, 1).finish(Outcome.OK, 2)
    qos.force_overload_state(OverloadState.YELLOW)  # defer: admitted, the engine holds it
    qos.admit(TENANTS.get("free"), 1, 1).finish(Outcome.ABORT, 0)
    qos.force_overload_state(None)
    assert engine.tiers_set[-1] == frozenset({"guaranteed", "burstable", "best_effort"})


def test_rate_limit_rejection_is_429_with_headers_and_finish_is_idempotent() -> None:
    qos = _qos(FakeClock())
    free = TENANTS.get("free")
    tickets = [qos.admit(free, 1, 1) for _ in range(6)]
    with pytest.raises(ServerError) as err:
        qos.admit(free, 1, 1)
    assert (err.value.status, err.value.type, err.value.code) == (
        429,
        "requests",
        "rate_limit_exceeded",
    )
    headers = err.value.headers
    assert headers["Retry-After"] == "10" and headers["retry-after-ms"] == "10000"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    tickets[0].finish(Outcome.OK, 2)
    tickets[0].finish(Outcome.OK, 2)
    assert qos.admission.stats(free).num_running == 5
    assert qos.ratelimit_headers(TENANTS.get("gold")) == {}
    assert qos.ratelimit_headers(free)["x-ratelimit-limit-tokens"] == "1000"


def test_outcomes_and_engine_failures() -> None:
    cases = [
        (RuntimeError("x"), Outcome.ERROR, True),
        (EngineDeadError("x"), Outcome.ERROR, True),
        (ServerError(500, "x"), Outcome.ERROR, True),
        (draining_error(), Outcome.UNAVAILABLE, False),
        (ServerError(503, "x", code="overloaded"), Outcome.UNAVAILABLE, False),
        (ServerError(429, "x"), Outcome.RATE_LIMITED, False),
        (ServerError(404, "x"), Outcome.NOT_FOUND, False),
        (PromptTooLongError("x"), Outcome.BAD_REQUEST, False),
        (InvalidParameterError("p", "x"), Outcome.BAD_REQUEST, False),
    ]
    for exc, outcome, failure in cases:
        assert (outcome_of(exc), is_engine_failure(exc)) == (outcome, failure), exc


def test_cache_salt_namespaces_tenants() -> None:
    qos = _qos(FakeClock())
    gold, bulk = TENANTS.get("gold"), TENANTS.get("bulk")
    assert qos.cache_salt(gold, None) == "gold"
    assert qos.cache_salt(gold, "x") == "gold\x1fx" != qos.cache_salt(bulk, "x")
    qos.isolate_prefix_cache = False
    assert qos.cache_salt(gold, None) is None and qos.cache_salt(gold, "x") == "x"


def test_settings_refuse_an_api_key_with_tenants() -> None:
    with pytest.raises(InvalidParameterError, match="exclude each other"):
        ServerSettings(api_key="k", tenants=TENANTS)
    default = ServerSettings(api_key="k").tenants_config()
    assert default.ids == ("default",) and default.requires_auth
    assert not ServerSettings().tenants_config().requires_auth


def test_prefill_rate_is_an_ema_of_measured_samples() -> None:
    est = PrefillRateEstimator(alpha=0.5)
    assert est.update(100, 1.0) is None  # baseline only
    assert est.update(100, 1.0) is None  # nothing computed since
    assert est.update(1100, 2.0) == 1000.0  # first sample: 1000 tokens in 1 s
    assert est.update(1100, 3.0) == 1000.0  # busy without prefill: no sample
    assert est.update(1600, 3.25) == 0.5 * 2000.0 + 0.5 * 1000.0
    with pytest.raises(InvalidParameterError):
        PrefillRateEstimator(alpha=0)


def test_prefill_rate_starts_from_the_warm_up_seed() -> None:
    est = PrefillRateEstimator(alpha=0.5)
    assert est.update(0, 0.0, seed=4000.0) == 4000.0  # the warm-up's full step, at once
    assert est.update(1000, 1.0, seed=4000.0) == 0.5 * 1000.0 + 0.5 * 4000.0  # then the EMA
    assert PrefillRateEstimator().update(0, 0.0, seed=None) is None


def test_a_small_first_prompt_does_not_turn_a_fresh_server_red() -> None:
    """The trial's fault: a 7-token request measured 69 tok/s (mostly fixed step time), then
    one 700-token guaranteed prompt predicted 10 s against a 1 s SLO and turned the server
    red while it ran (0.28 s). Only representative steps count now (a quarter of the step
    budget: `StepStats`), so the 7-token step leaves the rate unmeasured and the TTFT signal
    silent; and the moment nothing runs or waits the state is green, hold or not."""
    clock = FakeClock(100.0)
    engine = FakeEngine()
    watcher = OverloadWatcher(engine, _qos(clock, engine))
    engine.snapshot.num_running, engine.snapshot.num_waiting = 0, 0
    assert watcher.tick(now_s=100.0) is OverloadState.GREEN  # baseline
    # The 7-token request ran: its step is below the representative size, nothing counted.
    engine.snapshot.num_prefill_tokens, engine.snapshot.prefill_busy_s = 7, 0.1
    engine.snapshot.num_running, engine.snapshot.num_waiting = 1, 1
    engine.snapshot.waiting = {"gold": WaitingLoad(100.0, 700)}
    assert watcher.tick(now_s=100.1) is OverloadState.GREEN
    assert watcher.snapshot()[1] is None and watcher.last_signals.predicted_ttft_s == 0.0
    # With a measured rate the same backlog would be red (700 / 69 tok/s = 10 s vs 1 s) ...
    engine.snapshot.num_full_prefill_tokens, engine.snapshot.full_prefill_busy_s = 7, 0.1
    watcher.tick(now_s=100.2)
    engine.snapshot.num_full_prefill_tokens, engine.snapshot.full_prefill_busy_s = 14, 0.2
    assert watcher.tick(now_s=100.3) is OverloadState.RED
    # ... but once it is served and the engine is idle, red ends at once, without the hold.
    engine.snapshot.waiting = {}
    engine.snapshot.num_running, engine.snapshot.num_waiting = 0, 0
    assert watcher.tick(now_s=100.4) is OverloadState.GREEN
    assert engine.tiers_set[-1] == frozenset({"guaranteed", "burstable", "best_effort"})


def test_signals_count_only_the_work_the_engine_may_start() -> None:
    stats = SimpleNamespace(
        kv_cache_usage=0.5,
        waiting={
            "gold": WaitingLoad(oldest_arrival_s=98.0, num_prefill_tokens=300),
            "free": WaitingLoad(oldest_arrival_s=90.0, num_prefill_tokens=700),
            "bulk": WaitingLoad(oldest_arrival_s=None, num_prefill_tokens=100),
        },
    )
    every = overload_signals(stats, 100.0, 1000.0, 500.0)
    assert (every.queue_delay_s, every.predicted_ttft_s, every.kv_usage) == (10.0, 1.1, 0.5)
    assert every.ttft_ratio == pytest.approx(2.2)
    gold = overload_signals(stats, 100.0, 1000.0, 500.0, lambda t: t == "gold")
    assert (gold.queue_delay_s, gold.predicted_ttft_s) == (2.0, 0.3)
    unmeasured = overload_signals(stats, 100.0, None, None)
    assert (unmeasured.predicted_ttft_s, unmeasured.ttft_ratio) == (0.0, 0.0)


def test_state_changes_warn_only_when_some_tenant_can_be_shed(caplog) -> None:
    for tenants, level, suffix in (
        (TENANTS, "WARNING", ""),
        (TenantsConfig.default(), "INFO", ": every tenant is guaranteed, nothing is shed"),
    ):
        caplog.clear()
        engine = FakeEngine()
        watcher = OverloadWatcher(engine, _qos(FakeClock(100.0), engine, tenants))
        tenant_id = tenants.tenants[0].id
        engine.snapshot.waiting = {tenant_id: WaitingLoad(98.0, 50)}  # waited 2 s: yellow
        with caplog.at_level("INFO", logger="sits.server.qos.overload_watch"):
            assert watcher.tick(now_s=100.0) is OverloadState.YELLOW
        (record,) = [r for r in caplog.records if r.name == "sits.server.qos.overload_watch"]
        assert record.levelname == level
        assert record.getMessage().startswith("overload state green -> yellow")
        assert record.getMessage().endswith("TTFT 0.00 s)" + suffix)


def test_watcher_steps_up_defers_and_recovers() -> None:
    clock = FakeClock(100.0)
    engine = FakeEngine()
    qos = _qos(clock, engine)
    watcher = OverloadWatcher(engine, qos)
    assert watcher.tick(now_s=100.0) is OverloadState.GREEN and engine.tiers_set == []
    # Burstable and best-effort backlogs are their own: no state change, borrowing goes on.
    engine.snapshot.waiting = {"free": WaitingLoad(80.0, 50), "bulk": WaitingLoad(70.0, 900)}
    assert watcher.tick(now_s=100.0) is OverloadState.GREEN and engine.tiers_set == []
    # Borrowed blocks are reclaimable: 95 % used of which 50 % borrowed counts as 45 %.
    engine.snapshot.num_total_blocks = 100
    engine.snapshot.kv_cache_usage = 0.95
    engine.snapshot.tenants["bulk"] = _sched(70, 20, blocks_borrowed=50)
    assert watcher.tick(now_s=100.0) is OverloadState.GREEN
    assert watcher.last_signals.kv_usage == pytest.approx(0.45)
    # A guaranteed request waits 2 s (yellow threshold 1 s): yellow, borrowing stops.
    engine.snapshot.waiting = {"gold": WaitingLoad(98.0, 50), "bulk": WaitingLoad(70.0, 900)}
    assert watcher.tick(now_s=100.0) is OverloadState.YELLOW
    assert watcher.last_signals.queue_delay_s == 2.0
    assert engine.tiers_set == [frozenset({"guaranteed"})]
    # Served: calm, and green after the hold.
    engine.snapshot.waiting = {"bulk": WaitingLoad(70.0, 900)}
    assert watcher.tick(now_s=110.0) is OverloadState.YELLOW
    clock.advance(OverloadThresholds().hold_s)
    assert watcher.tick(now_s=115.0) is OverloadState.GREEN
    assert engine.tiers_set[-1] == frozenset({"guaranteed", "burstable", "best_effort"})
    # Measured prefill of 1000 tokens/s and 2500 guaranteed tokens queued against a 1 s
    # TTFT SLO: predicted 2.5 s, ratio 2.5 >= 2: red.
    engine.snapshot.num_full_prefill_tokens, engine.snapshot.full_prefill_busy_s = 1000, 1.0
    engine.snapshot.waiting = {"gold": WaitingLoad(None, 2500)}
    assert watcher.tick(now_s=116.0) is OverloadState.RED
    assert watcher.snapshot() == (watcher.last_signals, 1000.0)
    assert watcher.last_signals.predicted_ttft_s == 2.5


def test_a_borrowers_own_backlog_past_its_slo_sheds_its_new_over_quota_work() -> None:
    clock = FakeClock(100.0)
    engine = FakeEngine()
    tenants = TenantsConfig(
        (
            tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5, ttft_ms=1000),
            tenant("bulk", tier=Tier.BURSTABLE, reserved_kv_fraction=0.2, ttft_ms=3000),
            tenant("free", tier=Tier.BEST_EFFORT),
        )
    )
    settings = QosSettings(clock=clock)
    metrics = TenantMetrics(CollectorRegistry(), "m", tenants)
    qos = ServerQos(engine, tenants, settings, metrics, isolate_prefix_cache=True)
    bulk, free, gold = tenants.get("bulk"), tenants.get("free"), tenants.get("gold")
    engine.snapshot.tenants["bulk"] = _sched(20, 20)  # holds its reservation: would borrow
    engine.snapshot.waiting = {
        "bulk": WaitingLoad(97.5, 100),  # 2.5 s <= 0.9 x its 3 s TTFT SLO
        "free": WaitingLoad(95.5, 100),  # 4.5 s <= 0.9 x the 5 s red queue delay (no SLO)
        "gold": WaitingLoad(50.0, 100),  # guaranteed: never shed by its backlog
    }
    for t in (bulk, free, gold):
        qos.admit(t, 1, 1).finish(Outcome.OK, 2)
    clock.advance(1.0)  # bulk waited 3.5 s, free 5.5 s
    for t, waited, limit in (
        (bulk, "3.5", "2.7 s (0.9 x its 3"),
        (free, "5.5", "4.5 s (0.9 x its 5"),
    ):
        with pytest.raises(ServerError) as err:
            qos.admit(t, 1, 1)
        assert (err.value.status, err.value.code) == (503, "overloaded")
        assert f"has waited {waited} s, over {limit} s first-token limit)" in err.value.message
        assert err.value.headers == {"Retry-After": "5", "retry-after-ms": "5000"}
    assert qos.overload_state is OverloadState.GREEN
    ticket = qos.admit(gold, 1, 1)
    assert ticket.queue_timeout_s is None  # guaranteed: never shed while queued
    assert ticket.start_within_s is None
    ticket.finish(Outcome.OK, 2)
    engine.snapshot.tenants["bulk"] = _sched(5, 20, running=1)  # within its reservation
    ticket = qos.admit(bulk, 1, 1)
    assert ticket.queue_timeout_s is None
    ticket.finish(Outcome.OK, 2)
    engine.snapshot.waiting = {}
    engine.snapshot.tenants["bulk"] = _sched(20, 20)  # over quota: shed if queued past 2.7 s
    for t, limit_s in ((bulk, 3.0), (free, 5.0)):
        ticket = qos.admit(t, 1, 1)
        assert ticket.queue_timeout_s == limit_s and ticket.retry_after_s == 5
        # The engine must start it with 10 % of the limit left for the first token.
        assert ticket.start_within_s == pytest.approx(0.9 * limit_s)
        ticket.finish(Outcome.OK, 2)
    # backlog_shed_factor 2: limits 6 s and 10 s, so new work is admitted while bulk's oldest
    # queued request has waited up to 5.4 s and free's up to 9 s.
    engine.snapshot.tenants["bulk"] = _sched(20, 20)
    engine.snapshot.waiting = {"bulk": WaitingLoad(96.0, 100), "free": WaitingLoad(92.5, 100)}
    lenient = QosSettings(clock=clock, overload=OverloadThresholds(backlog_shed_factor=2.0))
    qos = ServerQos(engine, tenants, lenient, metrics, isolate_prefix_cache=True)
    for t, limit_s in ((bulk, 6.0), (free, 10.0)):
        ticket = qos.admit(t, 1, 1)
        assert ticket.queue_timeout_s == limit_s
        ticket.finish(Outcome.OK, 2)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidParameterError) as err:
            OverloadThresholds(backlog_shed_factor=bad)
        assert err.value.param == "backlog_shed_factor"


def test_the_ttft_slo_is_judged_on_the_ttft_from_the_http_receipt() -> None:
    registry = CollectorRegistry()
    metrics = TenantMetrics(registry, "m", TENANTS)
    gold = TENANTS.get("gold")  # TTFT SLO 1 s
    metrics.observe_ttft(gold, 0.4, 1.3)  # the engine's 0.4 s meets it; 1.3 s from receipt not
    metrics.observe_ttft(gold, 0.4, 0.9)
    metrics.observe_ttft(gold, 0.4)  # no receipt time (not over HTTP): judged on the engine's

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m", "tenant": "gold", **labels})

    assert value("sits:tenant_slo_requests_total", slo="ttft") == 3
    assert value("sits:tenant_slo_met_total", slo="ttft") == 2
    assert value("sits:tenant_time_to_first_token_seconds_count") == 3
    assert value("sits:tenant_time_to_first_token_seconds_sum") == pytest.approx(1.2)
    assert value("sits:tenant_http_time_to_first_token_seconds_count") == 2
    assert value("sits:tenant_http_time_to_first_token_seconds_sum") == pytest.approx(2.2)


def test_a_shed_request_misses_each_slo_of_its_tenant() -> None:
    registry = CollectorRegistry()
    tenants = TenantsConfig(
        (
            tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5, ttft_ms=1000),
            tenant("paced", tier=Tier.BURSTABLE, ttft_ms=2000, tpot_ms=50),
            tenant("free", tier=Tier.BEST_EFFORT),
        )
    )
    metrics = TenantMetrics(registry, "m", tenants)
    metrics.observe_ttft(tenants.get("gold"), 0.2, 0.3)  # served within its SLO
    for tenant_id, outcome in (("gold", "503"), ("gold", "429"), ("gold", "400")):
        metrics.count_outcome(tenant_id, outcome)  # only the 503 is the server's doing
    metrics.count_outcome("paced", "503", num_prompts=2)  # SLOs count per prompt
    metrics.count_outcome("free", "503")  # no SLO: nothing to miss

    def value(name: str, tenant_id: str, slo: str) -> float:
        labels = {"model_name": "m", "tenant": tenant_id, "slo": slo}
        return registry.get_sample_value(name, labels)

    counts = {
        (tenant_id, slo): (
            value("sits:tenant_slo_requests_total", tenant_id, slo),
            value("sits:tenant_slo_met_total", tenant_id, slo),
        )
        for tenant_id in ("gold", "paced", "free")
        for slo in ("ttft", "tpot")
    }
    assert counts == {
        ("gold", "ttft"): (2, 1),
        ("gold", "tpot"): (0, 0),
        ("paced", "ttft"): (2, 0),
        ("paced", "tpot"): (2, 0),
        ("free", "ttft"): (0, 0),
        ("free", "tpot"): (0, 0),
    }


def test_prompt_tokens_count_only_once_the_request_was_scheduled() -> None:
    from sits.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from sits.core.sampling_params import SamplingParams
    from sits.obs.server_metrics import ServerMetrics
    from sits.server.jobs import EnginePrompt

    metrics = ServerMetrics(SimpleNamespace(), "m")
    metrics.tenants = TenantMetrics(metrics.registry, "m", TENANTS)
    gold = TENANTS.get("gold")
    prompt = EnginePrompt(None, [5] * 7, SamplingParams(max_tokens=4))

    def output(scheduled_s: float | None, token_ids: list[int], reason: str | None):
        timing = RequestMetrics(arrival_time=1.0, first_scheduled_time=scheduled_s)
        if reason is not None:
            timing.finished_time = 2.0
        sample = CompletionOutput(0, token_ids=token_ids, finish_reason=reason)
        return RequestOutput("r", None, [5] * 7, None, [sample], reason is not None, timing)

    shed = metrics.recorder(prompt, gold)  # shed while queued: never scheduled
    shed.on_output(output(None, [], "abort"))
    served = metrics.recorder(prompt, gold)
    served.on_output(output(1.5, [9], None))
    served.on_output(output(1.5, [9], "length"))

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("sits:prompt_tokens_total") == 7
    assert value("sits:tenant_prompt_tokens_total", tenant="gold") == 7
    assert value("sits:generation_tokens_total") == 2
