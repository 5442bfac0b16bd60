"""Cost metrics: GPU-seconds per tenant and, with a GPU price, cost per 1M tokens per tenant.

Read at scrape time from the engine's stats (`AsyncLLM.EngineStats`): `busy_s`, the wall time
of every engine step that scheduled tokens, and `tenant_busy_s`, each tenant's share of it
(every step split by the tenants' scheduled tokens, `sits.engine.stats.split_step_time`). One
engine runs on one device, so its busy seconds are its GPU-seconds.
- `sits:gpu_seconds_total`: the engine's busy seconds;
- `sits:tenant_gpu_seconds_total{tenant}`: each configured tenant's share (0 before any work;
  the tenant label only takes configured tenant ids, a bounded set).
With a price (`--gpu-price-per-hour P`, P > 0; the currency is the price's):
- `sits:gpu_price_per_hour`: P;
- `sits:tenant_cost_total{tenant}`: tenant GPU-seconds / 3600 * P;
- `sits:tenant_cost_per_million_tokens{tenant}`: that cost / (the tenant's prompt + generated
  tokens, as clients were billed in `usage`) * 1e6, since start; only for tenants with tokens.
Over a window, `rate(cost_total) / rate(tokens) * 1e6` gives the recent figure (Grafana).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.obs.tenant_metrics import TenantMetrics
from sits.tenancy import TenantsConfig

SECONDS_PER_HOUR = 3600.0


def tenant_token_totals(tenant_metrics: TenantMetrics) -> dict[str, float]:
    """Tenant id -> prompt + generated tokens counted so far (from its counters)."""
    totals: dict[str, float] = {}
    for counter in (tenant_metrics.prompt_tokens, tenant_metrics.generation_tokens):
        for family in counter.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    tenant_id = sample.labels["tenant"]
                    totals[tenant_id] = totals.get(tenant_id, 0.0) + sample.value
    return totals


def cost_per_million_tokens(
    gpu_s: float, num_tokens: float, gpu_price_per_hour: float
) -> float | None:
    """Cost of `gpu_s` GPU-seconds at `gpu_price_per_hour`, per 1M of `num_tokens` tokens;
    None without tokens."""
    if num_tokens <= 0:
        return None
    return gpu_s / SECONDS_PER_HOUR * gpu_price_per_hour / num_tokens * 1e6


class CostCollector(Collector):
    """The cost families of the module docstring.

    Args:
        engine_stats: returns the engine's latest stats (may raise when the engine is dead;
            a stats object without `busy_s` / `tenant_busy_s` counts as 0).
        tenants: the configured tenants (the `tenant` label values).
        tenant_metrics: their token counters (for cost per 1M tokens).
        model_name: value of the `model_name` label.
        gpu_price_per_hour: price of one GPU-hour; 0 turns the cost families off.
    """

    def __init__(
        self,
        engine_stats: Callable[[], object],
        tenants: TenantsConfig,
        tenant_metrics: TenantMetrics,
        model_name: str,
        gpu_price_per_hour: float = 0.0,
    ) -> None:
        self.engine_stats = engine_stats
        self.tenants = tenants
        self.tenant_metrics = tenant_metrics
        self.model_name = model_name
        self.gpu_price_per_hour = gpu_price_per_hour

    def tenant_gpu_seconds(self) -> tuple[float, dict[str, float]]:
        """(engine GPU-seconds, configured tenant id -> its GPU-seconds); zeros for a dead
        engine."""
        try:
            stats = self.engine_stats()
        except Exception:  # noqa: BLE001 - a dead engine has no stats; scrape the rest
            return 0.0, {tenant.id: 0.0 for tenant in self.tenants}
        shares = getattr(stats, "tenant_busy_s", None) or {}
        per_tenant = {tenant.id: float(shares.get(tenant.id, 0.0)) for tenant in self.tenants}
        return float(getattr(stats, "busy_s", 0.0)), per_tenant

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        model = [self.model_name]
        labels = ["model_name", "tenant"]
        busy_s, per_tenant = self.tenant_gpu_seconds()
        total = CounterMetricFamily(
            "sits:gpu_seconds",
            "Wall seconds of the engine's steps that scheduled tokens (one device).",
            labels=["model_name"],
        )
        total.add_metric(model, busy_s)
        yield total
        tenant_s = CounterMetricFamily(
            "sits:tenant_gpu_seconds",
            "The tenant's share of the engine's GPU-seconds (each step split by its tokens).",
            labels=labels,
        )
        for tenant_id, seconds in per_tenant.items():
            tenant_s.add_metric(model + [tenant_id], seconds)
        yield tenant_s
        price = self.gpu_price_per_hour
        if price <= 0:
            return
        gauge = GaugeMetricFamily(
            "sits:gpu_price_per_hour", "Configured price of one GPU-hour.", labels=["model_name"]
        )
        gauge.add_metric(model, price)
        yield gauge
        cost = CounterMetricFamily(
            "sits:tenant_cost", "The tenant's GPU-seconds times the GPU price.", labels=labels
        )
        per_million = GaugeMetricFamily(
            "sits:tenant_cost_per_million_tokens",
            "The tenant's cost per 1M prompt + generated tokens since start.",
            labels=labels,
        )
        tokens = tenant_token_totals(self.tenant_metrics)
        for tenant_id, seconds in per_tenant.items():
            cost.add_metric(model + [tenant_id], seconds / SECONDS_PER_HOUR * price)
            value = cost_per_million_tokens(seconds, tokens.get(tenant_id, 0.0), price)
            if value is not None:
                per_million.add_metric(model + [tenant_id], value)
        yield from (cost, per_million)
