"""Prometheus metrics of one server (`GET /metrics`), named like vLLM's with the prefix `sits:`.

Each app owns its `CollectorRegistry` (never the global one), so tests can build several apps
in one process. Gauges (running, waiting, KV usage, preemptions) are read from
`engine.stats()` at scrape time; counters and histograms are fed by `RequestRecorder`, which
sees every output of an engine request:
- TTFT = first_token_time - arrival_time, queue time = first_scheduled_time - arrival_time,
  E2E = finished_time - arrival_time, once per engine request;
- inter-token latency: the time between the arrivals of two successive outputs that carry new
  tokens (timed on arrival: the engine's timestamps may already belong to a later step);
- time per output token: (last_token_time - first_token_time) / (tokens - 1) per sample;
- prompt tokens once per engine request (when its first output arrives), generation tokens as
  they arrive; request_success_total once per sample, labelled by its finish reason.
MoE experts (from `stats.experts`, refreshed by the engine every few steps; absent for dense
models): `sits:moe_expert_tokens_total{layer,expert}`, `sits:moe_expert_anomalous_checks_total
{layer,expert}`, `sits:moe_expert_frozen{layer,expert}` (0/1), `sits:moe_expert_imbalance{layer}`
(max/mean) and the alert counter `sits:moe_expert_auto_freezes_total`; labels are bounded by
the model's layers x experts. Restores from the checkpoint: `sits:moe_expert_restores_total`
and, of those, `sits:moe_expert_spare_restores_total` (into a spare slot); with spare expert
slots also `sits:moe_spare_slots{layer,state}`: state "free" = slots ready for the next
restore, "used" = experts served from a spare slot (restored away from their load-time slot).
With the load-aware expert placement (`--expert-router-policy load-aware`):
`sits:moe_expert_placement_imbalance{when}` (when "before" / "after": the last re-placement's
max over mean rank load, on its window's tokens, of the old and the new placement) and
`sits:moe_expert_replacements_total`.
The same tokens, TTFTs and TPOTs also feed the request's tenant's metrics and SLO counters
(`sits.obs.tenant_metrics`), when the recorder is given the tenant.
Also as vLLM: per request, prefill time (first token - first scheduled), decode time (last
token - first token), inference time (last token - first scheduled) and its prompt and
generation token counts as histograms. KV cache per tier: `sits:kv_tier_blocks_used{tier}`
and `sits:kv_tier_blocks_capacity{tier}` (tier: device, host; a gauge, so not `*_total`). Each
ended engine request that produced an output also leaves its timings in
`ServerMetrics.timelines` (a bounded ring; the dashboard's request timelines and latency
percentiles).
Times are `time.monotonic()` seconds (the engine's timestamps except for inter-token latency).
The rest of vLLM's set (tokens per step, request parameters, cache config, process and Python
collectors) and the rule that /metrics shows no `*_created` series: `sits.obs.vllm_metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.core.outputs import RequestMetrics, RequestOutput
from sits.core.sampling_params import SamplingParams
from sits.obs.expert_metrics import expert_families
from sits.obs.output_observer import OutputObserver
from sits.obs.tenant_metrics import TenantMetrics
from sits.obs.timeline import RequestTimeline, TimelineBuffer
from sits.obs.vllm_metrics import (
    EngineInfoCollector,
    VllmRequestHistograms,
    exposition,
    register_standard_collectors,
)
from sits.tenancy import TenantConfig

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TOKEN_COUNT_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))


class EngineStatsSource(Protocol):
    """What the metrics read of the engine (`sits.server.engine_client.EngineClient` is one)."""

    def stats(self) -> Any:
        """The engine's latest stats (`AsyncLLM.EngineStats`); may raise once it died."""


class EnginePromptLike(Protocol):
    """What a recorder reads of a prompt (`sits.server.jobs.EnginePrompt` is one)."""

    token_ids: list[int]
    params: SamplingParams


class _EngineStatsCollector(Collector):
    """Reads the engine's load at scrape time."""

    def __init__(self, engine: EngineStatsSource, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - a dead engine has no stats; scrape the rest
            return
        gauges = (
            ("sits:num_requests_running", "Requests running on the engine.", stats.num_running),
            ("sits:num_requests_waiting", "Requests waiting to run.", stats.num_waiting),
            (
                "sits:kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (1 = full).",
                stats.kv_cache_usage,
            ),
            ("sits:num_free_blocks", "Free KV cache blocks.", stats.num_free_blocks),
            ("sits:num_total_blocks", "KV cache blocks in all.", stats.num_total_blocks),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family
        preemptions = CounterMetricFamily(
            "sits:num_preemptions", "Requests preempted so far.", labels=["model_name"]
        )
        preemptions.add_metric([self.model_name], float(stats.num_preemptions))
        yield preemptions
        for name, doc, value in (
            (
                "sits:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.num_prefix_cache_query_tokens,
            ),
            (
                "sits:prefix_cache_hits",
                "Prompt tokens served from the prefix cache.",
                stats.num_prefix_cache_hit_tokens,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(value))
            yield counter
        yield from _host_tier_families(stats, self.model_name)
        yield from _kv_tier_families(stats, self.model_name)
        experts = getattr(stats, "experts", None)
        if experts is not None:
            yield from expert_families(experts, self.model_name)


def _host_tier_families(
    stats, model_name: str
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Host KV tier metrics: swap traffic, recomputed prefill tokens, host prefix cache hits
    and copies, host blocks in use."""
    swap = getattr(stats, "swap", None)
    if swap is None:
        return
    counters = (
        ("sits:kv_swap_out_blocks", "Swapped KV blocks copied out.", swap.num_swap_out_blocks),
        ("sits:kv_swap_in_blocks", "Swapped KV blocks copied back.", swap.num_swap_in_blocks),
        ("sits:kv_swapped_bytes", "KV bytes of swap preemption.", swap.num_swapped_bytes),
        (
            "sits:recomputed_prefill_tokens",
            "Computed tokens dropped by recompute preemption (prefilled again later).",
            swap.num_recomputed_tokens,
        ),
        (
            "sits:host_prefix_cache_hits",
            "Prompt tokens served from the host tier's prefix cache (copied in, not recomputed).",
            swap.num_host_hit_tokens,
        ),
        (
            "sits:host_prefix_cache_stored_blocks",
            "Prefix blocks evicted from the device and copied to the host tier.",
            swap.num_host_stored_blocks,
        ),
        (
            "sits:host_prefix_cache_loaded_blocks",
            "Host-tier prefix blocks copied back to the device on a hit.",
            swap.num_host_loaded_blocks,
        ),
        (
            "sits:host_prefix_cache_bytes",
            "KV bytes of host prefix cache copies, both directions.",
            swap.num_host_cache_bytes,
        ),
    )
    for name, doc, value in counters:
        counter = CounterMetricFamily(name, doc, labels=["model_name"])
        counter.add_metric([model_name], float(value))
        yield counter
    for name, doc, value in (
        ("sits:host_kv_blocks_used", "Host KV blocks in use.", stats.num_host_blocks_used),
        ("sits:host_kv_blocks_capacity", "Host KV blocks in all.", stats.num_host_blocks_total),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
        gauge.add_metric([model_name], float(value))
        yield gauge


def _kv_tier_families(stats, model_name: str) -> Iterator[GaugeMetricFamily]:
    """KV blocks used and in all per tier: device (the paged cache) and host (0 without one)."""
    device_used = stats.num_total_blocks - stats.num_free_blocks
    tiers = (
        ("device", device_used, stats.num_total_blocks),
        (
            "host",
            getattr(stats, "num_host_blocks_used", 0),
            getattr(stats, "num_host_blocks_total", 0),
        ),
    )
    labels = ["model_name", "tier"]
    used = GaugeMetricFamily(
        "sits:kv_tier_blocks_used", "KV blocks in use per tier.", labels=labels
    )
    total = GaugeMetricFamily("sits:kv_tier_blocks_capacity", "KV blocks per tier.", labels=labels)
    for tier, num_used, num_total in tiers:
        used.add_metric([model_name, tier], float(num_used))
        total.add_metric([model_name, tier], float(num_total))
    yield from (used, total)


class ServerMetrics:
    """The metrics of one server; `render()` is the `/metrics` body.

    Args:
        engine: read for the gauges at scrape time.
        model_name: value of the `model_name` label.

    Attributes:
        tenants: the per-tenant metrics on the same registry, once the server set them.
        timelines: the timings of the latest ended engine requests.
    """

    def __init__(self, engine: EngineStatsSource, model_name: str) -> None:
        self.model_name = model_name
        self.tenants: TenantMetrics | None = None
        self.timelines = TimelineBuffer()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(engine, model_name))
        self.registry.register(EngineInfoCollector(engine, model_name))
        register_standard_collectors(self.registry)  # process_*, python_*
        self.vllm = VllmRequestHistograms(self.registry, getattr(engine, "max_model_len", None))
        labels = ["model_name"]
        reg = self.registry
        self.request_success = Counter(
            "sits:request_success",
            "Finished samples by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "sits:prompt_tokens", "Prompt tokens processed.", labels, registry=reg
        )
        self.generation_tokens = Counter(
            "sits:generation_tokens", "Tokens generated.", labels, registry=reg
        )
        self.ttft = Histogram(
            "sits:time_to_first_token_seconds",
            "Time to first token (engine arrival to first token).",
            labels,
            buckets=_TTFT_BUCKETS_S,
            registry=reg,
        )
        self.itl = Histogram(
            "sits:inter_token_latency_seconds",
            "Time between successive token outputs of a request.",
            labels,
            buckets=_ITL_BUCKETS_S,
            registry=reg,
        )
        self.tpot = Histogram(
            "sits:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per sample.",
            labels,
            buckets=_ITL_BUCKETS_S,
            registry=reg,
        )
        self.e2e = Histogram(
            "sits:e2e_request_latency_seconds",
            "End-to-end request latency (engine arrival to finish).",
            labels,
            buckets=_E2E_BUCKETS_S,
            registry=reg,
        )
        self.queue_time = Histogram(
            "sits:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            labels,
            buckets=_E2E_BUCKETS_S,
            registry=reg,
        )

        self.prefill_time = Histogram(
            "sits:request_prefill_time_seconds",
            "Time from first scheduling to the first token, per request.",
            labels,
            buckets=_E2E_BUCKETS_S,
            registry=reg,
        )
        self.decode_time = Histogram(
            "sits:request_decode_time_seconds",
            "Time from the first to the last token, per request.",
            labels,
            buckets=_E2E_BUCKETS_S,
            registry=reg,
        )
        self.inference_time = Histogram(
            "sits:request_inference_time_seconds",
            "Time from first scheduling to the last token, per request.",
            labels,
            buckets=_E2E_BUCKETS_S,
            registry=reg,
        )
        self.request_prompt_tokens = Histogram(
            "sits:request_prompt_tokens",
            "Prompt tokens per request.",
            labels,
            buckets=_TOKEN_COUNT_BUCKETS,
            registry=reg,
        )
        self.request_generation_tokens = Histogram(
            "sits:request_generation_tokens",
            "Generated tokens per request (all samples).",
            labels,
            buckets=_TOKEN_COUNT_BUCKETS,
            registry=reg,
        )

    def recorder(
        self,
        prompt: EnginePromptLike,
        tenant: TenantConfig | None = None,
        received_s: float | None = None,
    ) -> RequestRecorder:
        """An observer recording one engine request's outputs (for `tenant` too, if given;
        `received_s`: the HTTP request's receipt, time.monotonic() seconds)."""
        params = prompt.params
        return RequestRecorder(
            self, len(prompt.token_ids), params.n, tenant, received_s, params.max_tokens
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (no `*_created` series)."""
        return generate_latest(exposition(self.registry))


class RequestRecorder(OutputObserver):
    """Feeds `ServerMetrics` from the DELTA outputs of one engine request (all its samples).

    With a tenant and `received_s` (the HTTP request's receipt, time.monotonic() seconds,
    `sits.server.request_tracing.ReceivedAtMiddleware`), the first token's arrival here also
    gives the tenant's TTFT from receipt.
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        num_prompt_tokens: int,
        num_samples: int,
        tenant: TenantConfig | None = None,
        received_s: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.m = metrics
        self.max_tokens = max_tokens
        self.t = metrics.tenants if tenant is not None else None
        self.tenant = tenant
        self.received_s = received_s
        self.num_prompt_tokens = num_prompt_tokens
        self.num_samples = num_samples
        self.counted_prompt = False
        self.saw_first_token = False
        self.last_token_time: float | None = None
        self.tokens_by_sample: dict[int, int] = {}
        self.finished_samples: set[int] = set()
        self.finish_reason: str | None = None
        self.last_output: RequestOutput | None = None
        self.tpot_s: float | None = None
        # The children updated on every token, looked up once per request: three `labels()`
        # calls per token cost 4.8 us against 1.6 us with the children kept (CPU, timeit), of
        # the HTTP process's ~90 us per streamed token.
        label = metrics.model_name
        self._generation_tokens = metrics.generation_tokens.labels(label)
        self._itl = metrics.itl.labels(label)
        self._tenant_generation_tokens = (
            None if self.t is None else self.t.generation_tokens_of(tenant.id)
        )

    def on_output(self, output: RequestOutput) -> None:
        label = self.m.model_name
        metrics = output.metrics
        self.last_output = output
        if not self.counted_prompt:
            self._count_prompt(metrics)
        num_new = 0
        for sample in output.outputs:
            num_new += len(sample.token_ids)
            count = self.tokens_by_sample.get(sample.index, 0) + len(sample.token_ids)
            self.tokens_by_sample[sample.index] = count
            if sample.finish_reason is not None and sample.index not in self.finished_samples:
                self.finished_samples.add(sample.index)
                self.m.request_success.labels(label, sample.finish_reason).inc()
                self.finish_reason = self.finish_reason or sample.finish_reason
        if num_new:
            self._generation_tokens.inc(num_new)
            if self._tenant_generation_tokens is not None:
                self._tenant_generation_tokens.inc(num_new)
            self._observe_token_times(output)
        if output.finished and metrics is not None and metrics.finished_time is not None:
            self.m.e2e.labels(label).observe(max(metrics.finished_time - metrics.arrival_time, 0))
            self._observe_tpot(output)
            self._observe_phases(output)
            self._record_end(metrics.finished_time, self.finish_reason or "stop")

    def _count_prompt(self, metrics: RequestMetrics | None) -> None:
        """Count the prompt tokens and the queue time once, when an output shows the request
        was scheduled (or carries no metrics): a request shed while queued never was, and
        its prompt was not processed."""
        if metrics is not None and metrics.first_scheduled_time is None:
            return
        self.counted_prompt = True
        label = self.m.model_name
        self.m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        if self.t is not None:
            self.t.add_prompt_tokens(self.tenant.id, self.num_prompt_tokens)
        if metrics is not None:
            queued_s = metrics.first_scheduled_time - metrics.arrival_time
            self.m.queue_time.labels(label).observe(max(queued_s, 0.0))

    def _observe_token_times(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if metrics is None:
            return
        # The engine's metrics object may already reflect later steps when an output is read,
        # so the gap between outputs (and the TTFT from receipt) is timed here, on arrival.
        now = time.monotonic()
        if not self.saw_first_token and metrics.first_token_time is not None:
            self.saw_first_token = True
            ttft_s = max(metrics.first_token_time - metrics.arrival_time, 0.0)
            self.m.ttft.labels(self.m.model_name).observe(ttft_s)
            if self.t is not None:
                received_s = self.received_s
                http_ttft_s = None if received_s is None else now - received_s
                self.t.observe_ttft(self.tenant, ttft_s, http_ttft_s)
        if self.last_token_time is not None:
            self._itl.observe(now - self.last_token_time)
        self.last_token_time = now

    def _observe_tpot(self, output: RequestOutput) -> None:
        metrics = output.metrics
        assert metrics is not None
        if metrics.first_token_time is None or metrics.last_token_time is None:
            return
        span_s = metrics.last_token_time - metrics.first_token_time
        tpots_s = []
        for count in self.tokens_by_sample.values():
            if count > 1:
                tpot_s = max(span_s, 0.0) / (count - 1)
                tpots_s.append(tpot_s)
                self.m.tpot.labels(self.m.model_name).observe(tpot_s)
                if self.t is not None:
                    self.t.observe_tpot(self.tenant, tpot_s)
        if tpots_s:
            self.tpot_s = sum(tpots_s) / len(tpots_s)

    def _observe_phases(self, output: RequestOutput) -> None:
        """Prefill, decode and inference time of a finished request (when it has the stamps)."""
        metrics = output.metrics
        assert metrics is not None
        label = self.m.model_name
        scheduled, first, last = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.last_token_time,
        )
        if scheduled is not None and first is not None:
            self.m.prefill_time.labels(label).observe(max(first - scheduled, 0.0))
        if first is not None and last is not None:
            self.m.decode_time.labels(label).observe(max(last - first, 0.0))
        if scheduled is not None and last is not None:
            self.m.inference_time.labels(label).observe(max(last - scheduled, 0.0))

    def _record_end(self, finished_s: float, finish_reason: str) -> None:
        """Per-request token histograms and the request's timeline (once it produced output)."""
        label = self.m.model_name
        num_output_tokens = sum(self.tokens_by_sample.values())
        self.m.request_prompt_tokens.labels(label).observe(self.num_prompt_tokens)
        self.m.request_generation_tokens.labels(label).observe(num_output_tokens)
        most = max(self.tokens_by_sample.values(), default=0)
        self.m.vllm.observe(label, self.num_samples, self.max_tokens, most)
        output = self.last_output
        if output is None or output.metrics is None:
            return
        metrics = output.metrics
        self.m.timelines.add(
            RequestTimeline(
                request_id=output.request_id,
                tenant_id=self.tenant.id if self.tenant is not None else "default",
                num_samples=self.num_samples,
                arrival_s=metrics.arrival_time,
                first_scheduled_s=metrics.first_scheduled_time,
                first_token_s=metrics.first_token_time,
                last_token_s=metrics.last_token_time,
                finished_s=finished_s,
                num_prompt_tokens=self.num_prompt_tokens,
                num_cached_tokens=output.num_cached_tokens,
                num_output_tokens=num_output_tokens,
                tpot_s=self.tpot_s,
                finish_reason=finish_reason,
            )
        )

    def on_abort(self) -> None:
        aborted = False
        for index in range(self.num_samples):
            if index not in self.finished_samples:
                aborted = True
                self.finished_samples.add(index)
                self.m.request_success.labels(self.m.model_name, "abort").inc()
        if aborted:
            self._record_end(time.monotonic(), "abort")
