"""The rest of vLLM's metric set on a server's registry, and the exposition rules of /metrics.

Besides what `sits.obs.server_metrics` records, vLLM exports (here with the prefix `sits:`):
- `iteration_tokens_total`: a histogram of the tokens of each engine step (prompt chunk tokens
  and decodes), read at scrape time from the engine's cumulative step buckets
  (`EngineStats.step_tokens_buckets`, counted in `ITERATION_TOKEN_BUCKETS`);
- per finished request: `request_params_n` (its n), `request_params_max_tokens` (the
  max_tokens it ran with) and `request_max_num_generation_tokens` (the most tokens one of its
  samples generated), histograms fed by `VllmRequestHistograms.observe`;
- `cache_config_info`: a gauge of value 1 whose labels are the KV cache's configuration;
- the standard `process_*` (CPU, memory, open files) and `python_*` (interpreter, garbage
  collector) collectors of prometheus_client, on the server's own registry.
`exposition(registry)` is what /metrics renders: every family less its `*_created` samples
(prometheus_client adds one per counter and histogram; vLLM's scrapers expect none), done per
render instead of through prometheus_client's process-wide switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# vLLM's buckets of `iteration_tokens_total` (tokens per engine step).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's request_params_n buckets
_DEFAULT_MAX_MODEL_LEN = 1 << 20


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


class VllmRequestHistograms:
    """vLLM's per-request parameter histograms (see the module docstring).

    Args:
        registry: where they are registered.
        max_model_len: the context length, the top of the 1-2-5 buckets (None: 2**20).
    """

    def __init__(self, registry: CollectorRegistry, max_model_len: int | None) -> None:
        labels = ["model_name"]
        buckets = one_two_five_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)
        self.n = Histogram(
            "sits:request_params_n",
            "The n parameter of finished requests.",
            labels,
            buckets=_N_BUCKETS,
            registry=registry,
        )
        self.max_tokens = Histogram(
            "sits:request_params_max_tokens",
            "The max_tokens parameter of finished requests.",
            labels,
            buckets=buckets,
            registry=registry,
        )
        self.max_num_generation_tokens = Histogram(
            "sits:request_max_num_generation_tokens",
            "The most tokens one sample of a finished request generated.",
            labels,
            buckets=buckets,
            registry=registry,
        )

    def observe(
        self, model_name: str, n: int, max_tokens: int | None, max_generation_tokens: int
    ) -> None:
        """Record one finished request (max_tokens None: not known, not recorded)."""
        self.n.labels(model_name).observe(n)
        if max_tokens is not None:
            self.max_tokens.labels(model_name).observe(max_tokens)
        self.max_num_generation_tokens.labels(model_name).observe(max_generation_tokens)


class EngineInfoCollector(Collector):
    """`iteration_tokens_total` and `cache_config_info`, read from the engine at scrape time.

    Args:
        engine: its `stats()` (step buckets, blocks) and, when present, its `config`
            (`EngineConfig`: the cache's settings).
        model_name: the `model_name` label.
    """

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001 - a dead engine has no stats; scrape the rest
            return
        counts = tuple(getattr(stats, "step_tokens_buckets", ()))
        if len(counts) == len(ITERATION_TOKEN_BUCKETS) + 1:
            steps = HistogramMetricFamily(
                "sits:iteration_tokens_total",
                "Tokens per engine step (prompt chunk tokens and decodes).",
                labels=["model_name"],
            )
            cumulative, running = [], 0
            for bound, count in zip((*ITERATION_TOKEN_BUCKETS, float("inf")), counts):
                running += count
                cumulative.append((str(float(bound)) if bound != float("inf") else "+Inf", running))
            steps.add_metric([self.model_name], cumulative, float(stats.step_tokens_sum))
            yield steps
        config = getattr(self.engine, "config", None)
        if config is not None:
            yield self._cache_config(config, stats)

    def _cache_config(self, config: Any, stats: Any) -> GaugeMetricFamily:
        labels = {
            "model_name": self.model_name,
            "block_size": str(config.block_size),
            "cache_dtype": str(config.kv_cache_dtype),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": str(config.gpu_memory_utilization),
            "num_gpu_blocks": str(stats.num_total_blocks),
            "num_cpu_blocks": str(getattr(stats, "num_host_blocks_total", 0)),
            "swap_space": str(config.swap_space),
        }
        info = GaugeMetricFamily(
            "sits:cache_config_info", "Information of the KV cache configuration.", labels=labels
        )
        info.add_metric(list(labels.values()), 1.0)
        return info


def register_standard_collectors(registry: CollectorRegistry) -> None:
    """prometheus_client's process_* and python_* collectors, on `registry` (not the global
    one)."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    if GC_COLLECTOR is not None:
        GCCollector(registry=registry)


class _WithoutCreated:
    """A registry view whose families carry no `*_created` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def exposition(registry: CollectorRegistry) -> Any:
    """What /metrics renders of `registry` (for `generate_latest`): no `*_created` series."""
    return _WithoutCreated(registry)
