"""Cost accounting without a server: the split of a step's time, the engine's per-tenant
GPU-seconds, scheduled tokens and prefill chunk ring, and the cost metric families."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from sits.config import EngineConfig
from sits.core.sampling_params import SamplingParams
from sits.engine.builder import build_engine
from sits.engine.output_processor import make_engine_requests
from sits.engine.stats import split_step_time
from sits.obs.cost_metrics import CostCollector, cost_per_million_tokens
from sits.obs.tenant_metrics import TenantMetrics
from sits.tenancy import TenantsConfig
from tests.server.tenant_fixtures import tenant

BUDGET_TOKENS = 16
# (request id, tenant, prompt length, max_tokens)
REQUESTS = (("a0", "a", 40, 5), ("a1", "a", 7, 5), ("b0", "b", 23, 9))


def test_split_step_time_is_proportional_to_tokens() -> None:
    assert split_step_time({"a": 3, "b": 1}, 2.0) == {"a": 1.5, "b": 0.5}
    assert split_step_time({"a": 5}, 0.25) == {"a": 0.25}
    assert split_step_time({}, 1.0) == {}


def test_engine_charges_each_tenant_its_scheduled_tokens(tiny_model_factory) -> None:
    config = EngineConfig(
        model=str(tiny_model_factory("qwen2")),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=BUDGET_TOKENS,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=4 << 20,
    )
    core = build_engine(config).core
    for request_id, tenant_id, prompt_len, max_tokens in REQUESTS:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        prompt = [5 + (i * 13) % 200 for i in range(prompt_len)]
        for request in make_engine_requests(
            request_id,
            prompt,
            params,
            eos_token_ids=(),
            max_model_len=256,
            enable_prefix_caching=False,
            tenant_id=tenant_id,
        ):
            core.add_request(request)
    while core.has_unfinished_requests():
        core.step()
    # Every prompt token once, then one decode per token but the last: prompt + max_tokens - 1.
    assert core.stats.tenant_scheduled_tokens == {"a": (40 + 4) + (7 + 4), "b": 23 + 8}
    assert core.stats.busy_s > 0
    assert set(core.stats.tenant_busy_s) == {"a", "b"}
    assert all(seconds > 0 for seconds in core.stats.tenant_busy_s.values())
    assert sum(core.stats.tenant_busy_s.values()) == pytest.approx(core.stats.busy_s, rel=1e-9)
    for request_id, _, prompt_len, _ in REQUESTS:
        chunks = [c for c in core.stats.prefill_chunks if c.request_id == request_id]
        positions = [c.start_position for c in chunks]
        assert positions[0] == 0
        for before, after in zip(chunks, chunks[1:]):
            assert after.start_position == before.start_position + before.num_tokens
            assert after.start_s >= before.end_s
        assert sum(c.num_tokens for c in chunks) == prompt_len
        assert all(0 < c.num_tokens <= BUDGET_TOKENS and c.end_s > c.start_s for c in chunks)
    assert len([c for c in core.stats.prefill_chunks if c.request_id == "a0"]) >= 3


TENANTS = TenantsConfig((tenant("a"), tenant("b"), tenant("idle")))


def _collector(price: float, stats: object) -> tuple[CostCollector, TenantMetrics]:
    def engine_stats() -> object:
        if isinstance(stats, Exception):
            raise stats
        return stats

    metrics = TenantMetrics(CollectorRegistry(), "m", TENANTS)
    return CostCollector(engine_stats, TENANTS, metrics, "m", price), metrics


def _families(collector: CostCollector) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for family in collector.collect():
        for sample in family.samples:
            out.setdefault(sample.name, {})[sample.labels.get("tenant", "")] = sample.value
    return out


def test_cost_families_from_gpu_seconds_price_and_tokens() -> None:
    stats = SimpleNamespace(busy_s=100.0, tenant_busy_s={"a": 72.0, "b": 28.0, "other": 1.0})
    collector, metrics = _collector(2.0, stats)
    metrics.add_prompt_tokens("a", 600)
    metrics.add_generation_tokens("a", 400)
    families = _families(collector)
    assert families["sits:gpu_seconds_total"] == {"": 100.0}
    # Only configured tenants are labels ("other" is not one).
    assert families["sits:tenant_gpu_seconds_total"] == {"a": 72.0, "b": 28.0, "idle": 0.0}
    assert families["sits:gpu_price_per_hour"] == {"": 2.0}
    cost = families["sits:tenant_cost_total"]
    assert cost == pytest.approx({"a": 72.0 / 3600 * 2.0, "b": 28.0 / 3600 * 2.0, "idle": 0.0})
    # 0.04 for 1000 tokens: 40 per million; tenants without tokens have no figure.
    assert families["sits:tenant_cost_per_million_tokens"] == pytest.approx({"a": 40.0})
    assert cost_per_million_tokens(72.0, 1000, 2.0) == pytest.approx(40.0)
    assert cost_per_million_tokens(72.0, 0, 2.0) is None


def test_no_price_no_cost_families_and_a_dead_engine_reads_zero() -> None:
    stats = SimpleNamespace(busy_s=3.0, tenant_busy_s={"a": 3.0})
    families = _families(_collector(0.0, stats)[0])
    assert set(families) == {"sits:gpu_seconds_total", "sits:tenant_gpu_seconds_total"}
    dead = _families(_collector(1.0, RuntimeError("engine died"))[0])
    assert dead["sits:tenant_gpu_seconds_total"] == {"a": 0.0, "b": 0.0, "idle": 0.0}
    assert dead["sits:tenant_cost_total"] == {"a": 0.0, "b": 0.0, "idle": 0.0}
    assert "sits:tenant_cost_per_million_tokens" not in dead  # no tokens, no figure
