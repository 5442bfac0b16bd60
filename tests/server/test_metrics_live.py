"""/metrics on a live multi-tenant MoE server with a GPU price: per-tenant counts equal what the
clients saw (C16 per tenant), GPU-seconds and cost per tenant add up, the vLLM per-request
histograms count every request, KV is exported per tier, label sets stay bounded, and every
metric the Grafana dashboard (deploy/grafana/sits.json) queries is exported."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import TenantsConfig
from tests.server.live import LiveServer, metric_samples
from tests.server.tenant_fixtures import NEVER_OVERLOADED, auth, tenant, tenant_engine

GRAFANA_JSON = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sits.json"
PRICE_PER_HOUR = 3.0
TENANTS = TenantsConfig(
    (
        tenant("gold", ttft_ms=600_000, tpot_ms=600_000),
        tenant("free", ttft_ms=0.001),
        tenant("idle"),
    )
)
# (tenant, prompt length, max_tokens)
BATCH = (("gold", 30, 6), ("gold", 50, 8), ("gold", 70, 10), ("free", 20, 5), ("free", 41, 7))
ALLOWED_LABELS = {
    "model_name", "tenant", "outcome", "slo", "reason", "dimension", "finished_reason", "le",
    "layer", "expert", "tier", "generation",
    # sits:cache_config_info: the KV cache's configuration, one series
    "block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
    "num_gpu_blocks", "num_cpu_blocks", "swap_space",
}  # fmt: skip
Series = tuple[str, tuple[tuple[str, str], ...]]


def _complete(base_url: str, index: int, spec: tuple[str, int, int]) -> dict:
    tenant_id, prompt_len, max_tokens = spec
    prompt = [7 + (index * 31 + i * 17) % 300 for i in range(prompt_len)]
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        response = http.post("/v1/completions", json=body, headers=auth(tenant_id))
    assert response.status_code == 200, response.text
    return {"tenant": tenant_id, **response.json()}


def _run_batch(live: LiveServer, offset: int) -> list[dict]:
    with ThreadPoolExecutor(len(BATCH)) as pool:
        return list(
            pool.map(lambda i: _complete(live.base_url, offset + i, BATCH[i]), range(len(BATCH)))
        )


def _scrape(live: LiveServer) -> tuple[str, dict[Series, float]]:
    with live.http() as http:
        text = http.get("/metrics").text
    return text, metric_samples(text)


@pytest.fixture(scope="module")
def run(tiny_moe_dir):
    """A server after one batch and after a second one: (live, responses, scrape 1, scrape 2)."""
    settings = ServerSettings(
        tenants=TENANTS,
        qos=QosSettings(overload=NEVER_OVERLOADED),  # free's SLO alone would turn it red
        gpu_price_per_hour=PRICE_PER_HOUR,
    )
    with LiveServer(tenant_engine(tiny_moe_dir, TENANTS), settings) as live:
        first = _run_batch(live, 0)
        assert live.wait_until(lambda: live.engine.stats().num_running == 0)
        scrape1 = _scrape(live)
        second = _run_batch(live, len(BATCH))
        assert live.wait_until(lambda: live.engine.stats().num_running == 0)
        scrape2 = _scrape(live)
        yield live, first + second, scrape1, scrape2


def test_tenant_counts_and_request_histograms_equal_what_clients_saw(run) -> None:
    live, responses, _, (_, samples) = run

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    for tenant_id in ("gold", "free"):
        mine = [r["usage"] for r in responses if r["tenant"] == tenant_id]
        prompt = sum(u["prompt_tokens"] for u in mine)
        generated = sum(u["completion_tokens"] for u in mine)
        assert value("sits:tenant_prompt_tokens_total", tenant=tenant_id) == prompt
        assert value("sits:tenant_generation_tokens_total", tenant=tenant_id) == generated
        assert value("sits:tenant_requests_total", tenant=tenant_id, outcome="ok") == len(mine)
    assert value("sits:tenant_slo_met_total", tenant="gold", slo="ttft") == 6
    assert value("sits:tenant_slo_requests_total", tenant="free", slo="ttft") == 4
    assert value("sits:tenant_slo_met_total", tenant="free", slo="ttft") == 0
    usages = [r["usage"] for r in responses]
    num = len(usages)
    assert value("sits:request_prompt_tokens_count") == num
    assert value("sits:request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usages)
    assert value("sits:request_generation_tokens_sum") == sum(
        u["completion_tokens"] for u in usages
    )
    for phase in ("prefill", "decode", "inference"):
        assert value(f"sits:request_{phase}_time_seconds_count") == num
        assert value(f"sits:request_{phase}_time_seconds_sum") > 0
    total_blocks = live.engine.stats().num_total_blocks
    assert value("sits:kv_tier_blocks_capacity", tier="device") == total_blocks
    assert value("sits:kv_tier_blocks_used", tier="device") == 0
    assert value("sits:kv_tier_blocks_capacity", tier="host") == 0


def test_gpu_seconds_and_cost_per_tenant(run) -> None:
    _, responses, _, (_, samples) = run

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    gpu_s = {t: value("sits:tenant_gpu_seconds_total", tenant=t) for t in ("gold", "free", "idle")}
    assert gpu_s["idle"] == 0
    assert gpu_s["gold"] > 0 and gpu_s["free"] > 0
    assert sum(gpu_s.values()) == pytest.approx(value("sits:gpu_seconds_total"), rel=1e-9)
    assert value("sits:gpu_price_per_hour") == PRICE_PER_HOUR
    for tenant_id in ("gold", "free"):
        cost = value("sits:tenant_cost_total", tenant=tenant_id)
        assert cost == pytest.approx(gpu_s[tenant_id] / 3600 * PRICE_PER_HOUR, rel=1e-9)
        usage = [r["usage"] for r in responses if r["tenant"] == tenant_id]
        num_tokens = sum(u["total_tokens"] for u in usage)
        per_million = value("sits:tenant_cost_per_million_tokens", tenant=tenant_id)
        assert per_million == pytest.approx(cost / num_tokens * 1e6, rel=1e-6)
    assert ("sits:tenant_cost_per_million_tokens", (("tenant", "idle"),)) not in samples


def test_label_sets_are_bounded(run) -> None:
    _, responses, (text1, samples1), (text2, samples2) = run
    # Twice the requests, the same series: nothing is labelled per request.
    assert set(samples1) == set(samples2)
    request_ids = {r["id"] for r in responses}
    assert len(request_ids) == 2 * len(BATCH)
    for name, labels in samples2:
        if name.startswith(("process_", "python_")):  # prometheus_client's standard collectors
            continue
        assert name.startswith("sits:"), name
        for label, label_value in labels:
            assert label in ALLOWED_LABELS, (name, label)
            assert label_value not in request_ids, (name, label)
            if label == "tenant":
                assert label_value in TENANTS.ids, (name, label_value)
    assert not any(rid in text2 for rid in request_ids)


def _queried_names(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else str(query))
    return {name for expr in exprs for name in re.findall(r"sits:[A-Za-z0-9_:]+", expr)}


def test_every_metric_the_grafana_dashboard_queries_is_exported(run) -> None:
    _, _, _, (_, samples) = run
    dashboard = json.loads(GRAFANA_JSON.read_text())
    exported = {name for name, _ in samples}
    queried = _queried_names(dashboard)
    assert len(queried) >= 40
    assert sorted(queried - exported) == []
    panel_ids = [p["id"] for p in dashboard["panels"]]
    assert len(panel_ids) == len(set(panel_ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"]: v["type"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource": "datasource", "model_name": "query", "tenant": "query"}
