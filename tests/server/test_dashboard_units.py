"""Dashboard pieces without an engine: nearest-rank percentiles, the bounded timeline ring,
prefill chunks matched to requests (n > 1 too), registry lookups, a tenant's load with and
without configured tenants, the engine's device, the admin-key gate of /dashboard/data, and
the GPU price setting and flag."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, Gauge

from sits.cli.serve import add_serve_parser
from sits.core.errors import InvalidParameterError
from sits.engine.stats import PrefillChunk
from sits.obs.dashboard_data import MetricSamples, chunks_by_request, tenant_load
from sits.obs.timeline import RequestTimeline, TimelineBuffer, latency_summary, percentiles
from sits.server import routes_dashboard
from sits.server.context import ServerSettings
from sits.server.errors import install_error_handlers
from sits.server.routes_dashboard import dashboard_html, dashboard_router, engine_device


def _timeline(request_id: str, n: int = 1, arrival_s: float = 10.0, **fields) -> RequestTimeline:
    values = dict(
        request_id=request_id,
        tenant_id="t",
        num_samples=n,
        arrival_s=arrival_s,
        first_scheduled_s=arrival_s + 0.5,
        first_token_s=arrival_s + 1.0,
        last_token_s=arrival_s + 3.0,
        finished_s=arrival_s + 3.0,
        num_prompt_tokens=4,
        num_cached_tokens=0,
        num_output_tokens=5,
        tpot_s=0.5,
        finish_reason="length",
    )
    values.update(fields)
    return RequestTimeline(**values)


def test_percentiles_are_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentiles(values) == {"p50": 3.0, "p90": 5.0, "p99": 5.0}
    assert percentiles(range(1, 101), (50, 90, 99, 100)) == {
        "p50": 50,
        "p90": 90,
        "p99": 99,
        "p100": 100,
    }
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert percentiles([]) == {}


def test_timeline_ring_keeps_the_latest_and_latency_skips_aborts() -> None:
    ring = TimelineBuffer(max_requests=3)
    for i in range(5):
        ring.add(_timeline(f"r{i}", first_token_s=10.0 + i))
    assert [t.request_id for t in ring.recent()] == ["r2", "r3", "r4"]
    assert len(ring) == 3 and ring.num_added == 5
    timeline = _timeline("x")
    assert (timeline.queue_s, timeline.ttft_s, timeline.e2e_s) == (0.5, 1.0, 3.0)
    never_run = _timeline("y", first_scheduled_s=None, first_token_s=None, finish_reason="abort")
    assert never_run.queue_s is None and never_run.ttft_s is None
    latency = latency_summary([*ring.recent(), never_run])
    assert latency["num_requests"] == 3
    assert latency["ttft_s"] == {"p50": 3.0, "p90": 4.0, "p99": 4.0}
    assert latency["queue_s"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}


def test_chunks_are_matched_to_their_request_and_samples() -> None:
    timelines = [_timeline("a"), _timeline("b", n=2), _timeline("c-p0")]
    chunks = [
        PrefillChunk("a", 1.0, 2.0, 0, 16),
        PrefillChunk("b-0", 1.0, 2.0, 0, 8),
        PrefillChunk("b-1", 2.0, 3.0, 0, 8),
        PrefillChunk("c-p0", 1.0, 2.0, 0, 3),
        PrefillChunk("b", 1.0, 2.0, 0, 99),  # not an engine id of n=2 request "b"
        PrefillChunk("zzz", 1.0, 2.0, 0, 1),  # a request no longer shown
        PrefillChunk("a", 2.0, 3.0, 16, 4),
    ]
    matched = chunks_by_request(timelines, chunks)
    assert {k: [c.num_tokens for c in v] for k, v in matched.items()} == {
        "a": [16, 4],
        "b": [8, 8],
        "c-p0": [3],
    }


def test_metric_samples_lookup_ignores_model_name() -> None:
    registry = CollectorRegistry()
    counter = Counter("sits:x", "x", ["model_name", "tenant"], registry=registry)
    counter.labels("m", "a").inc(3)
    counter.labels("m", "b").inc(4)
    samples = MetricSamples(registry)
    assert samples.get("sits:x_total", tenant="a") == 3
    assert samples.get("sits:x_total", tenant="nobody") == 0
    assert samples.by_label("sits:x_total", "tenant") == {"a": 3, "b": 4}


def test_tenant_load_is_the_engines_without_configured_tenants() -> None:
    registry = CollectorRegistry()
    for name, value in (("sits:num_requests_running", 3), ("sits:num_requests_waiting", 2)):
        Gauge(name, name, ["model_name"], registry=registry).labels("m").set(value)
    kv = Gauge("sits:kv_tier_blocks_used", "kv", ["model_name", "tier"], registry=registry)
    kv.labels("m", "device").set(40)
    kv.labels("m", "host").set(7)
    for name, value in (
        ("sits:tenant_num_requests_running", 1),
        ("sits:tenant_num_requests_waiting", 2),
        ("sits:tenant_kv_blocks_used", 9),
    ):
        Gauge(name, name, ["model_name", "tenant"], registry=registry).labels("m", "a").set(value)
    samples = MetricSamples(registry)
    assert tenant_load(samples, "default", per_tenant=False) == {
        "num_running": 3,
        "num_waiting": 2,
        "kv_blocks_used": 40,
    }
    assert tenant_load(samples, "a", per_tenant=True) == {
        "num_running": 1,
        "num_waiting": 2,
        "kv_blocks_used": 9,
    }
    assert tenant_load(samples, "b", per_tenant=True)["num_running"] == 0


def test_engine_device_is_the_device_type() -> None:
    engine = SimpleNamespace(info=SimpleNamespace(device=SimpleNamespace(type="cuda")))
    assert engine_device(engine) == "cuda"
    assert engine_device(SimpleNamespace()) is None  # a test double without model info


def test_dashboard_data_needs_the_admin_key_when_one_is_set() -> None:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(dashboard_router)
    app.state.ctx = SimpleNamespace(settings=SimpleNamespace(admin_key="sekret"))
    client = TestClient(app)
    assert client.get("/dashboard/data").status_code == 401
    wrong = client.get("/dashboard/data", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "forbidden"
    page = client.get("/dashboard")  # the page itself is static and asks for the key
    assert page.status_code == 200 and page.text == dashboard_html()
    assert 'id="key-form"' in page.text


def test_recent_requests_are_hidden_with_tenants_and_no_admin_key(monkeypatch) -> None:
    """A tenant never sees another's requests: with tenants and no admin key the data keeps
    its aggregates but no request (nor asks the engine for its chunks)."""
    full = {"totals": {"prompt_tokens": 7.0}, "requests": [{"request_id": "cmpl-1"}]}
    monkeypatch.setattr(
        routes_dashboard, "dashboard_data", lambda ctx, chunks: {**full, "chunks": chunks}
    )

    async def chunks(engine) -> list:
        return ["chunk"]

    monkeypatch.setattr(routes_dashboard, "_engine_chunks", chunks)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(dashboard_router)
    client = TestClient(app)
    tenants = object()  # any configured tenants
    for tenants_config, admin_key, shown in (
        (None, None, True),  # one default tenant: open like /metrics
        (tenants, None, False),
        (tenants, "sekret", True),  # the operator's key sees everything
    ):
        settings = SimpleNamespace(admin_key=admin_key, tenants=tenants_config)
        app.state.ctx = SimpleNamespace(settings=settings, engine=None)
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        data = client.get("/dashboard/data", headers=headers).json()
        assert data["totals"] == full["totals"]
        if shown:
            assert data["requests"] == full["requests"] and data["chunks"] == ["chunk"]
            assert data["requests_hidden"] is None
        else:
            assert data["requests"] == [] and data["chunks"] == []
            assert data["requests_hidden"] == routes_dashboard.REQUESTS_HIDDEN


def test_gpu_price_setting_and_flag() -> None:
    assert ServerSettings().gpu_price_per_hour == 0.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidParameterError) as err:
            ServerSettings(gpu_price_per_hour=bad)
        assert err.value.param == "gpu_price_per_hour"
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["serve", "--gpu-price-per-hour", "2.5"]).gpu_price_per_hour == 2.5
    assert parser.parse_args(["serve"]).gpu_price_per_hour == 0.0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--gpu-price-per-hour", "-3"])
