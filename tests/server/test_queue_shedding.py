"""Over-quota work of a burstable or best-effort tenant that gets no first token within its TTFT
limit (`OverloadThresholds.backlog_shed_factor` x ttft_ms) is shed with a 503 while queued,
streamed or not; guaranteed tenants and patient SLOs are served."""

from __future__ import annotations

import dataclasses

import pytest

from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import TenantsConfig, Tier
from tests.server.live import LiveServer
from tests.server.tenant_fixtures import (
    NEVER_OVERLOADED,
    auth,
    ctx_of,
    scrape,
    tenant,
    tenant_engine,
)

TENANTS = TenantsConfig(
    (
        tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5, ttft_ms=0.001),
        tenant("late", tier=Tier.BEST_EFFORT, ttft_ms=0.001),
        tenant("patient", tier=Tier.BEST_EFFORT, ttft_ms=600_000),
    )
)
BODY = {"prompt": "def fibonacci(n):", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def live(tiny_moe_dir):
    overload = dataclasses.replace(NEVER_OVERLOADED, backlog_shed_factor=1.0)
    settings = ServerSettings(tenants=TENANTS, qos=QosSettings(overload=overload))
    with LiveServer(tenant_engine(tiny_moe_dir, TENANTS), settings) as server:
        yield server


def test_queued_work_past_its_ttft_limit_is_shed(live: LiveServer) -> None:
    engine = ctx_of(live).engine

    def idle() -> bool:  # the shed request's abort has reached the engine's stats
        stats = engine.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    with live.http() as http:
        for stream in (False, True):
            assert live.wait_until(idle)  # else admission itself sheds (its queue aged)
            answer = http.post(
                "/v1/completions", json={**BODY, "stream": stream}, headers=auth("late")
            )
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "overloaded"
            assert (
                "got no first token within its 1e-06 s first-token limit while queued"
                in (error["message"])
            )
            assert answer.headers["retry-after"] == "5"
        for tenant_id in ("patient", "gold"):  # a long limit; guaranteed: never shed
            answer = http.post("/v1/completions", json=BODY, headers=auth(tenant_id))
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 3
    value = scrape(live)
    assert value("sits:tenant_requests_total", tenant="late", outcome="503") == 2
    assert value("sits:tenant_requests_total", tenant="patient", outcome="ok") == 1
    assert live.wait_until(idle)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
