"""The QoS gauges of one server, read at scrape time (`QosCollector`).

Every family carries `model_name` and, for tenant families, `tenant` (configured tenant ids
only, a bounded set):
- from the engine's per-tenant stats: `sits:tenant_kv_blocks_reserved`,
  `sits:tenant_kv_blocks_borrowed`, `sits:tenant_kv_blocks_used`,
  `sits:tenant_num_requests_running`, `sits:tenant_num_requests_waiting`,
  `sits:tenant_num_preemptions_total`;
- from admission: `sits:tenant_requests_in_flight`, `sits:tenant_admitted_requests_total`,
  `sits:tenant_rejected_requests_total{tenant, reason}`, and per limited dimension
  (requests, tokens) `sits:tenant_ratelimit_limit`, `sits:tenant_ratelimit_remaining`,
  `sits:tenant_ratelimit_used` (limit - remaining: what the window holds now);
- server-wide: `sits:overload_state` (0 green, 1 yellow, 2 red),
  `sits:overload_queue_delay_seconds`, `sits:overload_predicted_ttft_seconds`,
  `sits:prefill_tokens_per_second` (0 until measured), `sits:circuit_breaker_state`
  (0 closed, 1 half_open, 2 open) and `sits:circuit_breaker_opened_total`.
The per-tenant counters fed as requests end are `sits.obs.tenant_metrics.TenantMetrics`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.admission import BreakerState, OverloadSignals, RejectReason
from sits.server.qos.admit import ServerQos

_BREAKER_LEVEL = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class QosCollector(Collector):
    """Reads per-tenant scheduler and admission state, overload and breaker at scrape time.

    Args:
        qos: the server's QoS state (tenants, admission, breaker, overload state).
        engine_stats: returns the engine's latest stats (may raise when the engine is dead).
        signals: returns the overload watcher's last signals and prefill rate (or Nones).
        model_name: value of the `model_name` label.
    """

    def __init__(
        self,
        qos: ServerQos,
        engine_stats: Callable[[], object],
        signals: Callable[[], tuple[OverloadSignals | None, float | None]],
        model_name: str,
    ) -> None:
        self.qos = qos
        self.engine_stats = engine_stats
        self.signals = signals
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._server_wide()
        yield from self._admission()
        yield from self._scheduler()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], float(value))
        return family

    def _server_wide(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self.qos.overload_state
        yield self._gauge(
            "sits:overload_state", "Overload state: 0 green, 1 yellow, 2 red.", state.severity
        )
        signals, rate = self.signals()
        signals = signals or OverloadSignals()
        yield self._gauge(
            "sits:overload_queue_delay_seconds",
            "Wait of the oldest queued request at the last overload check.",
            signals.queue_delay_s,
        )
        yield self._gauge(
            "sits:overload_predicted_ttft_seconds",
            "Predicted time to first token of the queued work at the last overload check.",
            signals.predicted_ttft_s,
        )
        yield self._gauge(
            "sits:prefill_tokens_per_second",
            "Measured prefill rate (EMA), 0 until measured.",
            rate or 0.0,
        )
        breaker = self.qos.breaker
        yield self._gauge(
            "sits:circuit_breaker_state",
            "Circuit breaker: 0 closed, 1 half_open, 2 open.",
            _BREAKER_LEVEL[breaker.state],
        )
        opened = CounterMetricFamily(
            "sits:circuit_breaker_opened", "Times the breaker opened.", labels=["model_name"]
        )
        opened.add_metric([self.model_name], float(breaker.num_opened))
        yield opened

    def _admission(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["model_name", "tenant"]
        in_flight = GaugeMetricFamily(
            "sits:tenant_requests_in_flight", "Admitted requests not yet ended.", labels=labels
        )
        admitted = CounterMetricFamily(
            "sits:tenant_admitted_requests", "Requests admitted by the rate limits.", labels=labels
        )
        rejected = CounterMetricFamily(
            "sits:tenant_rejected_requests",
            "Requests refused by the tenant's limits, by reason.",
            labels=labels + ["reason"],
        )
        dims = labels + ["dimension"]
        limit = GaugeMetricFamily(
            "sits:tenant_ratelimit_limit", "Rate limit per window.", labels=dims
        )
        remaining = GaugeMetricFamily(
            "sits:tenant_ratelimit_remaining", "Whole units available now.", labels=dims
        )
        used = GaugeMetricFamily(
            "sits:tenant_ratelimit_used", "limit - remaining: units the window holds.", labels=dims
        )
        admission = self.qos.admission
        for tenant in self.qos.tenants:
            key = [self.model_name, tenant.id]
            stats = admission.stats(tenant)
            in_flight.add_metric(key, float(stats.num_running))
            admitted.add_metric(key, float(stats.num_admitted))
            for reason in RejectReason:
                count = stats.num_rejected.get(reason.value, 0)
                rejected.add_metric(key + [reason.value], float(count))
            snap = admission.snapshot(tenant)
            for dim, lim, rem in (
                ("requests", snap.limit_requests, snap.remaining_requests),
                ("tokens", snap.limit_tokens, snap.remaining_tokens),
            ):
                if lim is None or rem is None:
                    continue
                limit.add_metric(key + [dim], float(lim))
                remaining.add_metric(key + [dim], float(rem))
                used.add_metric(key + [dim], float(lim - rem))
        yield from (in_flight, admitted, rejected, limit, remaining, used)

    def _scheduler(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            tenants = getattr(self.engine_stats(), "tenants", None) or {}
        except Exception:  # noqa: BLE001 - a dead engine has no stats; scrape the rest
            return
        labels = ["model_name", "tenant"]
        gauges = (
            ("sits:tenant_kv_blocks_reserved", "KV blocks reserved.", "blocks_reserved"),
            ("sits:tenant_kv_blocks_borrowed", "KV blocks borrowed.", "blocks_borrowed"),
            ("sits:tenant_kv_blocks_used", "KV blocks its running requests hold.", "blocks_used"),
            ("sits:tenant_num_requests_running", "Its running requests.", "num_running"),
            ("sits:tenant_num_requests_waiting", "Its queued requests.", "num_waiting"),
        )  # fmt: skip
        for name, doc, attr in gauges:
            family = GaugeMetricFamily(name, doc, labels=labels)
            for tenant_id, stats in tenants.items():
                family.add_metric([self.model_name, tenant_id], float(getattr(stats, attr)))
            yield family
        preemptions = CounterMetricFamily(
            "sits:tenant_num_preemptions", "The tenant's requests preempted.", labels=labels
        )
        for tenant_id, stats in tenants.items():
            preemptions.add_metric([self.model_name, tenant_id], float(stats.num_preemptions))
        yield preemptions
