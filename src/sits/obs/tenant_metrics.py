"""Per-tenant Prometheus metrics, fed as requests end.

Every family carries `model_name` and, for tenant families, `tenant`; the tenant label only
takes configured tenant ids (a bounded set), and every other label a fixed set of values:
- fed as requests end (`TenantMetrics`):
  `sits:tenant_requests_total{tenant, outcome}` (outcome: ok, 400, 404, 429, 503, error,
  abort; a body refused before the handler runs counts as 400),
  `sits:tenant_prompt_tokens_total`, `sits:tenant_generation_tokens_total`,
  `sits:tenant_time_to_first_token_seconds` (from the hand-off to the engine),
  `sits:tenant_http_time_to_first_token_seconds` (from the HTTP request's receipt,
  `sits.server.request_tracing.ReceivedAtMiddleware`, to its first token in the HTTP
  process; the TTFT SLO counters use it, or the engine's TTFT for a request without a receipt
  time) and
  `sits:tenant_time_per_output_token_seconds` (histograms),
  `sits:tenant_slo_requests_total{tenant, slo}` and
  `sits:tenant_slo_met_total{tenant, slo}` (slo: ttft, tpot; attainment = met / requests;
  counted per engine request (one per prompt of a request); a request counts only for the
  SLOs its tenant has; a request the server sheds (503: red at admission, shed while queued,
  circuit open) never gets a token and counts as a miss of each, once per prompt, as
  `sits bench serve` counts it, so attainment is over the requests sent less those refused
  for the tenant's own faults: 400, 404 and 429).
The QoS gauges read at scrape time are `sits.server.qos.metrics.QosCollector`'s.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from sits.tenancy import TenantConfig, TenantsConfig

OUTCOMES = ("ok", "400", "404", "429", "503", "error", "abort")
SLO_KINDS = ("ttft", "tpot")
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
