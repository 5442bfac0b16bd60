"""The router's Prometheus metrics (`/metrics`, names `sits:router_*`), one registry per app.

Counters and histograms are updated by the proxy as requests end; the replica gauges (status,
breaker state, in-flight requests) and the canary gauges are read from the registry and the
canary controller at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.admission import BreakerState
from sits.router.canary import CanaryController, CanaryState
from sits.router.registry import Registry, ReplicaStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _StateCollector(Collector):
    """Replica status, breaker state, in-flight requests and the canary, at scrape time."""

    def __init__(self, registry: Registry, canary: Callable[[], CanaryController]) -> None:
        self._registry = registry
        self._canary = canary

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = self._registry.all()
        status = GaugeMetricFamily(
            "sits:router_replicas", "Replicas known to the router, by status.", labels=["status"]
        )
        for value in ReplicaStatus:
            status.add_metric([value.value], sum(r.status is value for r in replicas))
        yield status
        breaker = GaugeMetricFamily(
            "sits:router_breaker_state",
            "Circuit breaker state per replica (1 for its current state).",
            labels=["replica", "state"],
        )
        inflight = GaugeMetricFamily(
            "sits:router_replica_inflight_requests",
            "Requests the router has in flight on each replica.",
            labels=["replica", "pool", "version"],
        )
        up = GaugeMetricFamily(
            "sits:router_replica_up",
            "1 while the replica is in rotation (healthy), else 0.",
            labels=["replica", "pool", "version"],
        )
        for replica in replicas:
            now = replica.breaker.state
            for state in BreakerState:
                breaker.add_metric([replica.url, state.value], float(now is state))
            labels = [replica.url, replica.pool, replica.version_label]
            inflight.add_metric(labels, replica.inflight)
            up.add_metric(labels, float(replica.status is ReplicaStatus.HEALTHY))
        yield breaker
        yield inflight
        yield up
        canary = self._canary()
        yield GaugeMetricFamily(
            "sits:router_canary_weight",
            "Share of new requests sent to canary replicas, 0..1.",
            value=canary.weight,
        )
        state = GaugeMetricFamily(
            "sits:router_canary_state", "Canary state (1 for the current one).", labels=["state"]
        )
        for value in CanaryState:
            state.add_metric([value.value], float(canary.state is value))
        yield state


class RouterMetrics:
    """The router's metrics.

    Args:
        registry: the replicas (read at scrape time).
        canary: returns the canary controller (read at scrape time).
    """

    def __init__(self, registry: Registry, canary: Callable[[], CanaryController]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sits:router_requests",
            "Requests answered, by the replica that answered ('none' when no replica did) and "
            "HTTP status.",
            ["replica", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "sits:router_replica_errors",
            "Failed attempts per replica, by kind (connect, timeout, read, status_5xx, "
            "stream_cut, draining).",
            ["replica", "kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            "sits:router_retries",
            "Requests sent again to another replica, by the first attempt's failure kind.",
            ["kind"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "sits:router_routing_decisions",
            "Routing decisions, by reason (prefix_affinity, least_loaded, "
            "affinity_over_load_bound, fallback, canary, only_candidate).",
            ["reason"],
            registry=self.registry,
        )
        self.no_replica = Counter(
            "sits:router_no_replica",
            "Requests answered 503 because no replica could serve them.",
            registry=self.registry,
        )
        self.rate_limited = Counter(
            "sits:router_rate_limited",
            "Requests refused by a tenant's fleet-wide limits (429).",
            ["tenant"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "sits:router_time_to_first_token_seconds",
            "Streamed requests: seconds from the router's receipt to the first event.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "sits:router_e2e_request_latency_seconds",
            "Seconds from the router's receipt to the end of the answer.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StateCollector(registry, canary))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
