"""Tenants over HTTP: prefix-cache isolation, overload shedding and deferral, the circuit
breaker, and per-tenant metrics (outcomes, tokens, SLO attainment, reservations).

One live server (fake clock for the breaker) whose overload state is pinned by the tests
(`ServerQos.force_overload_state`) and always put back to the measured state.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from sits.admission import BreakerConfig, FakeClock, OverloadState
from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import TenantsConfig, Tier
from tests.server.live import LiveServer
from tests.server.tenant_fixtures import (
    NEVER_OVERLOADED,
    auth,
    ctx_of,
    key_of,
    scrape,
    tenant,
    tenant_engine,
)

PROMPT = "def fibonacci(n):"
TENANTS = TenantsConfig(
    (
        tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5),
        tenant("bulk", tier=Tier.BURSTABLE, reserved_kv_fraction=0.1),
        tenant("free", tier=Tier.BEST_EFFORT),
        tenant("iso-a"),
        tenant("iso-b"),
        tenant("flaky"),
        tenant("slo-met", ttft_ms=600_000),
        tenant("slo-miss", ttft_ms=0.001),
        tenant("slo-tpot", tpot_ms=600_000),
        tenant("capped", requests_per_minute=1),
    )
)
OPEN_S = 30.0


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(50.0)


@pytest.fixture(scope="module")
def live(tiny_moe_dir, clock):
    breaker = BreakerConfig(max_consecutive_failures=2, open_s=OPEN_S)
    settings = ServerSettings(
        tenants=TENANTS,
        qos=QosSettings(breaker=breaker, clock=clock, overload=NEVER_OVERLOADED),
        enable_prompt_tokens_details=True,
    )
    with LiveServer(tenant_engine(tiny_moe_dir, TENANTS), settings) as server:
        yield server


@pytest.fixture()
def pin_state(live):
    """`pin(state)` forces the overload state for one test."""
    qos = ctx_of(live).qos
    yield qos.force_overload_state
    qos.force_overload_state(None)


def _complete(http: httpx.Client, tenant_id: str, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body}
    return http.post("/v1/completions", json=body, headers=auth(tenant_id))


def test_prefix_cache_is_isolated_per_tenant(live) -> None:
    prompt = [7 + (i * 13) % 500 for i in range(100)]  # 6 full blocks of 16 tokens
    model = live.engine.model_name
    client_a = live.client(api_key=key_of("iso-a"))
    client_b = live.client(api_key=key_of("iso-b"))

    def cached(client, **extra) -> int:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=1, **extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(client_a) == 0
    assert cached(client_a) == 96  # every full block of the prompt, from A's first request
    assert cached(client_b) == 0  # same prompt, other tenant: no hit
    assert cached(client_b) == 96
    assert cached(client_a, extra_body={"cache_salt": "x"}) == 0  # a salt within the tenant
    body = {"prompt": prompt, "max_tokens": 1, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with (
        live.http() as http,
        http.stream("POST", "/v1/completions", json=body, headers=auth("iso-a")) as resp,
    ):
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    usage = json.loads(events[-2])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 96}
    messages = [{"role": "user", "content": "Tell me a long story about the sea. " * 8}]
    chats = [
        client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        for client in (client_b, client_b, client_a)
    ]
    num_prompt = chats[0].usage.prompt_tokens
    assert num_prompt > 32
    cached_chat = [c.usage.prompt_tokens_details.cached_tokens for c in chats]
    assert cached_chat == [0, (num_prompt - 1) // 16 * 16, 0]


def test_red_sheds_best_effort_and_keeps_serving_guaranteed(live, pin_state) -> None:
    pin_state(OverloadState.RED)
    with live.http() as http:
        shed = _complete(http, "free")
        gold = _complete(http, "gold")
        bulk = _complete(http, "bulk")  # idle burstable: within its reservation
        value = scrape(live)
    assert shed.status_code == 503
    assert shed.json()["error"]["code"] == "overloaded"
    assert shed.headers["retry-after"] == "5" and shed.headers["retry-after-ms"] == "5000"
    assert shed.headers["x-sits-overload-state"] == "red"
    assert gold.status_code == 200 and gold.headers["x-sits-overload-state"] == "red"
    assert bulk.status_code == 200
    assert value("sits:overload_state") == 2
    assert value("sits:tenant_requests_total", tenant="free", outcome="503") >= 1
    stats = live.engine.stats
    assert live.wait_until(lambda: stats().borrowing_tiers == ("guaranteed",))


def test_refusals_that_need_no_tokens_never_reach_the_tokenizer(live, monkeypatch) -> None:
    """The trial's 429 storm: refused requests queued on the one tokenizer thread ahead of a
    guaranteed tenant's. A tenant over its request rate is now refused before tokenization
    (`ServerQos.precheck`), with the same 429, headers and counts, and a shed request too."""
    ctx = ctx_of(live)
    tokenized: list[str] = []
    run_tokenizer = ctx.run_tokenizer

    async def counting(fn, tenant, *args):
        tokenized.append(tenant.id)
        return await run_tokenizer(fn, tenant, *args)

    monkeypatch.setattr(ctx, "run_tokenizer", counting)
    with live.http() as http:
        first = _complete(http, "capped")
        refused = [_complete(http, "capped") for _ in range(5)]
        value = scrape(live)
    assert first.status_code == 200
    assert [r.status_code for r in refused] == [429] * 5
    assert {r.json()["error"]["code"] for r in refused} == {"rate_limit_exceeded"}
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert tokenized == ["capped"]  # only the admitted request was tokenized
    assert value("sits:tenant_requests_total", tenant="capped", outcome="429") == 5


def test_yellow_defers_best_effort_until_green(live, pin_state) -> None:
    pin_state(OverloadState.YELLOW)
    stats = live.engine.stats
    assert live.wait_until(lambda: stats().borrowing_tiers == ("guaranteed",))
    results: list[httpx.Response] = []

    def send_free() -> None:
        with live.http() as own:
            results.append(_complete(own, "free"))

    with live.http() as http:
        waiting = threading.Thread(target=send_free)
        waiting.start()
        assert live.wait_until(lambda: stats().tenants["free"].num_waiting == 1)
        assert _complete(http, "gold", max_tokens=8).status_code == 200  # the engine runs
        assert stats().tenants["free"].num_waiting == 1 and not results  # free still waits
        pin_state(OverloadState.GREEN)
        waiting.join(30)
    assert results and results[0].status_code == 200
    assert stats().borrowing_tiers == ("guaranteed", "burstable", "best_effort")


def test_breaker_opens_on_engine_errors_and_recovers(live, clock) -> None:
    calls: list[str] = []

    async def broken(request_id, *args, **kwargs):
        calls.append(request_id)
        raise RuntimeError("injected engine failure")
        yield  # an async generator, like AsyncLLM.generate

    with live.http() as http:
        assert _complete(http, "flaky", max_tokens=-1).status_code == 400  # not a failure
        live.engine.generate = broken
        try:
            failed = [_complete(http, "flaky") for _ in range(2)]
            refused = _complete(http, "flaky")
        finally:
            del live.engine.generate
        assert [r.status_code for r in failed] == [500, 500] and len(calls) == 2
        assert all(r.headers["x-sits-overload-state"] == "green" for r in failed)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "circuit_open"
        assert refused.headers["retry-after"] == str(int(OPEN_S))
        assert scrape(live)("sits:circuit_breaker_state") == 2
        clock.advance(OPEN_S)  # half-open: the next request is the probe
        assert _complete(http, "flaky").status_code == 200
    value = scrape(live)
    assert value("sits:circuit_breaker_state") == 0
    assert value("sits:circuit_breaker_opened_total") == 1
    assert value("sits:tenant_requests_total", tenant="flaky", outcome="error") == 2
    assert value("sits:tenant_requests_total", tenant="flaky", outcome="503") == 1
    assert value("sits:tenant_requests_total", tenant="flaky", outcome="ok") == 1
    assert value("sits:tenant_requests_total", tenant="flaky", outcome="400") == 1


def test_per_tenant_metrics_and_slo_attainment(live) -> None:
    with live.http() as http:
        met = [_complete(http, "slo-met", max_tokens=4, ignore_eos=True) for _ in range(2)]
        missed = _complete(http, "slo-miss", max_tokens=3, ignore_eos=True)
        tpot = _complete(http, "slo-tpot", max_tokens=5, ignore_eos=True, n=2)
    assert all(r.status_code == 200 for r in [*met, missed, tpot])
    num_prompt = met[0].json()["usage"]["prompt_tokens"]
    value = scrape(live)
    assert value("sits:tenant_requests_total", tenant="slo-met", outcome="ok") == 2
    assert value("sits:tenant_prompt_tokens_total", tenant="slo-met") == 2 * num_prompt
    assert value("sits:tenant_generation_tokens_total", tenant="slo-met") == 8
    assert value("sits:tenant_generation_tokens_total", tenant="slo-tpot") == 10
    slo = "sits:tenant_slo_requests_total"
    assert value(slo, tenant="slo-met", slo="ttft") == 2
    assert value("sits:tenant_slo_met_total", tenant="slo-met", slo="ttft") == 2
    assert value(slo, tenant="slo-met", slo="tpot") == 0  # no TPOT SLO: not measured
    assert value(slo, tenant="slo-miss", slo="ttft") == 1
    assert value("sits:tenant_slo_met_total", tenant="slo-miss", slo="ttft") == 0
    assert value(slo, tenant="slo-tpot", slo="tpot") == 2  # one per sample
    assert value("sits:tenant_slo_met_total", tenant="slo-tpot", slo="tpot") == 2
    assert value("sits:tenant_time_to_first_token_seconds_count", tenant="slo-met") == 2
    # From the HTTP receipt, which precedes the hand-off to the engine, to the first token's
    # arrival in the HTTP process, which follows its production: each such TTFT is longer.
    http_ttft = "sits:tenant_http_time_to_first_token_seconds"
    assert value(f"{http_ttft}_count", tenant="slo-met") == 2
    assert value(f"{http_ttft}_count", tenant="slo-tpot") == 1  # one engine request, n=2
    for tenant_id in ("slo-met", "slo-miss", "slo-tpot"):
        engine_s = value("sits:tenant_time_to_first_token_seconds_sum", tenant=tenant_id)
        assert value(f"{http_ttft}_sum", tenant=tenant_id) > engine_s > 0
    assert value("sits:tenant_time_per_output_token_seconds_count", tenant="slo-tpot") == 2
    total_blocks = live.engine.stats().num_total_blocks
    assert total_blocks > 100
    assert value("sits:tenant_kv_blocks_reserved", tenant="gold") == total_blocks // 2
    assert value("sits:tenant_kv_blocks_reserved", tenant="bulk") == total_blocks // 10
    assert value("sits:tenant_kv_blocks_reserved", tenant="free") == 0
    assert value("sits:tenant_kv_blocks_borrowed", tenant="bulk") == 0  # idle
    assert value("sits:tenant_requests_in_flight", tenant="slo-met") == 0
