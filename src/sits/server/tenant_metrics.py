"""Per-tenant Prometheus metrics, and the QoS gauges read at scrape time.

Every family carries `model_name` and, for tenant families, `tenant`; the tenant label only
takes configured tenant ids (a bounded set), and every other label a fixed set of values:
- fed as requests end (`TenantMetrics`):
  `sits:tenant_requests_total{tenant, outcome}` (outcome: ok, 400, 404, 429, 503, error,
  abort; a body refused before the handler runs counts as 400),
  `sits:tenant_prompt_tokens_total`, `sits:tenant_generation_tokens_total`,
  `sits:tenant_time_to_first_token_seconds` (from the hand-off to the engine),
  `sits:tenant_http_time_to_first_token_seconds` (from the HTTP request's receipt,
  `server.received`, to its first token in the HTTP process; the TTFT SLO counters use it,
  or the engine's TTFT for a request without a receipt time) and
  `sits:tenant_time_per_output_token_seconds` (histograms),
  `sits:tenant_slo_requests_total{tenant, slo}` and
  `sits:tenant_slo_met_total{tenant, slo}` (slo: ttft, tpot; attainment = met / requests;
  counted per engine request (one per prompt of a request); a request counts only for the
  SLOs its tenant has; a request the server sheds (503: red at admission, shed while queued,
  circuit open) never gets a token and counts as a miss of each, once per prompt, as
  `sits bench serve` counts it, so attainment is over the requests sent less those refused
  for the tenant's own faults: 400, 404 and 429);
- read at scrape time (`QosCollector`): from the engine's per-tenant stats
  `sits:tenant_kv_blocks_reserved`, `sits:tenant_kv_blocks_borrowed`,
  `sits:tenant_kv_blocks_used`, `sits:tenant_num_requests_running`,
  `sits:tenant_num_requests_waiting`, `sits:tenant_num_preemptions_total`; from admission
  `sits:tenant_requests_in_flight`, `sits:tenant_admitted_requests_total`,
  `sits:tenant_rejected_requests_total{tenant, reason}`, and per limited dimension
  (requests, tokens) `sits:tenant_ratelimit_limit`, `sits:tenant_ratelimit_remaining`,
  `sits:tenant_ratelimit_used` (limit - remaining: what the window holds now); server-wide
  `sits:overload_state` (0 green, 1 yellow, 2 red), `sits:overload_queue_delay_seconds`,
  `sits:overload_predicted_ttft_seconds`, `sits:prefill_tokens_per_second` (0 until measured),
  `sits:circuit_breaker_state` (0 closed, 1 half_open, 2 open) and
  `sits:circuit_breaker_opened_total`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.admission import BreakerState, OverloadSignals, RejectReason
from sits.tenancy import TenantConfig, TenantsConfig

if TYPE_CHECKING:
    from sits.server.qos import ServerQos

OUTCOMES = ("ok", "400", "404", "429", "503", "error", "abort")
SLO_KINDS = ("ttft", "tpot")
_BREAKER_LEVEL = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
_TTFT_BUCKETS_S = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
    80.0, 160.0,
)  # fmt: skip
_TPOT_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class TenantMetrics:
    """Counters and histograms per tenant, registered on the server's registry.

    Args:
        registry: the app's registry.
        model_name: value of the `model_name` label.
        tenants: every tenant (their ids are the `tenant` label values; their SLOs decide
            attainment). Counters are created at 0 for every tenant and label value.
    """

    def __init__(
        self, registry: CollectorRegistry, model_name: str, tenants: TenantsConfig
    ) -> None:
        self.model_name = model_name
        labels = ["model_name", "tenant"]
        self.requests = Counter(
            "sits:tenant_requests",
            "Requests by tenant and outcome (ok, 400, 404, 429, 503, error, abort).",
            labels + ["outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "sits:tenant_prompt_tokens", "Prompt tokens processed.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "sits:tenant_generation_tokens", "Tokens generated.", labels, registry=registry
        )
        self.ttft = Histogram(
            "sits:tenant_time_to_first_token_seconds",
            "Time to first token per engine request.",
            labels,
            buckets=_TTFT_BUCKETS_S,
            registry=registry,
        )
        self.http_ttft = Histogram(
            "sits:tenant_http_time_to_first_token_seconds",
            "Time from the HTTP request's receipt to its first token in the HTTP process "
            "(parsing, tokenization and admission included) per engine request.",
            labels,
            buckets=_TTFT_BUCKETS_S,
            registry=registry,
        )
        self.tpot = Histogram(
            "sits:tenant_time_per_output_token_seconds",
            "Mean time per output token after the first, per sample.",
            labels,
            buckets=_TPOT_BUCKETS_S,
            registry=registry,
        )
        self.slo_requests = Counter(
            "sits:tenant_slo_requests",
            "Requests measured against the tenant's SLO (by slo: ttft, tpot).",
            labels + ["slo"],
            registry=registry,
        )
        self.slo_met = Counter(
            "sits:tenant_slo_met",
            "Requests that met the tenant's SLO (by slo: ttft, tpot).",
            labels + ["slo"],
            registry=registry,
        )
        self._tenants = {tenant.id: tenant for tenant in tenants}
        for tenant in tenants:
            for outcome in OUTCOMES:
                self.requests.labels(model_name, tenant.id, outcome)
            for slo in SLO_KINDS:
                self.slo_requests.labels(model_name, tenant.id, slo)
                self.slo_met.labels(model_name, tenant.id, slo)

    def count_outcome(self, tenant_id: str, outcome: str, num_prompts: int = 1) -> None:
        """One request of the tenant ended with `outcome` (one of `OUTCOMES`); a 503 also
        misses each SLO the tenant has once per prompt (`num_prompts`: SLOs are counted per
        engine request, one per prompt, as for served requests; module docstring)."""
        assert outcome in OUTCOMES, outcome
        self.requests.labels(self.model_name, tenant_id, outcome).inc()
        tenant = self._tenants.get(tenant_id)
        if outcome == "503" and tenant is not None:
            for _ in range(max(num_prompts, 1)):
                self._slo(tenant_id, "ttft", tenant.ttft_ms, float("inf"))
                self._slo(tenant_id, "tpot", tenant.tpot_ms, float("inf"))

    def add_prompt_tokens(self, tenant_id: str, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name, tenant_id).inc(num_tokens)

    def add_generation_tokens(self, tenant_id: str, num_tokens: int) -> None:
        self.generation_tokens_of(tenant_id).inc(num_tokens)

    def generation_tokens_of(self, tenant_id: str) -> Counter:
        """The tenant's generation-token counter child (kept by a request's recorder, which
        adds to it on every token: `labels()` per token cost ~1 us each)."""
        return self.generation_tokens.labels(self.model_name, tenant_id)

    def observe_ttft(
        self, tenant: TenantConfig, ttft_s: float, http_ttft_s: float | None = None
    ) -> None:
        """Record a TTFT from the hand-off to the engine (seconds) and, when given, the TTFT
        from the HTTP request's receipt; when the tenant has a TTFT SLO, whether it was met,
        judged on the TTFT from receipt when there is one (what the client waits for, the
        network aside), else on the engine's."""
        self.ttft.labels(self.model_name, tenant.id).observe(ttft_s)
        if http_ttft_s is not None:
            self.http_ttft.labels(self.model_name, tenant.id).observe(http_ttft_s)
        self._slo(tenant.id, "ttft", tenant.ttft_ms, ttft_s if http_ttft_s is None else http_ttft_s)

    def observe_tpot(self, tenant: TenantConfig, tpot_s: float) -> None:
        """Record a sample's mean TPOT (seconds) and whether it met the tenant's TPOT SLO."""
        self.tpot.labels(self.model_name, tenant.id).observe(tpot_s)
        self._slo(tenant.id, "tpot", tenant.tpot_ms, tpot_s)

    def _slo(self, tenant_id: str, kind: str, slo_ms: float | None, value_s: float) -> None:
        if slo_ms is None:
            return
        self.slo_requests.labels(self.model_name, tenant_id, kind).inc()
        if value_s * 1000.0 <= slo_ms:
            self.slo_met.labels(self.model_name, tenant_id, kind).inc()


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
