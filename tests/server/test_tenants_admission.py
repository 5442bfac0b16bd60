"""Tenants over HTTP: auth (401), rate limits (C18, C19), rate-limit headers, per-request limits.

One live server with a fake admission clock, so windows, Retry-After and header values are
exact; each test uses its own tenant. C19 with the official client's retries runs on a second
server with the real clock and a 2 s window.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from sits.admission import FakeClock, format_reset
from sits.server.context import ServerSettings
from sits.server.params import default_max_tokens_cap
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
        tenant("c18", requests_per_minute=2, max_concurrent=1),
        tenant("c19", requests_per_minute=2),
        tenant("limited", requests_per_minute=10, tokens_per_minute=10_000),
        tenant("small", max_tokens_per_request=8, max_prompt_tokens=20),
        tenant("drop", max_concurrent=1, tokens_per_minute=100_000),
        tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5),
        tenant("sloppy"),
        tenant("metered", tokens_per_minute=120),
    )
)


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture(scope="module")
def live(tiny_moe_dir, clock):
    qos = QosSettings(clock=clock, overload=NEVER_OVERLOADED)
    settings = ServerSettings(tenants=TENANTS, qos=qos)
    with LiveServer(tenant_engine(tiny_moe_dir, TENANTS), settings) as server:
        yield server


def _complete(http: httpx.Client, tenant_id: str, **body) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body}
    return http.post("/v1/completions", json=body, headers=auth(tenant_id))


def test_missing_or_unknown_key_is_401(live) -> None:
    with live.http() as http:
        missing = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        unknown = http.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 2},
            headers={"Authorization": "Bearer not-a-key"},
        )
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    for resp, message in ((missing, "Missing API key"), (unknown, "Incorrect API key")):
        assert resp.status_code == 401
        error = resp.json()["error"]
        assert error["code"] == "invalid_api_key" and error["message"].startswith(message)
        assert "x-ratelimit-limit-requests" not in resp.headers
    with pytest.raises(openai.AuthenticationError):
        live.client(api_key="wrong").models.list()
    assert live.client(api_key=key_of("gold")).models.list().data


def test_c18_rate_limit_counts_only_admitted_work(live) -> None:
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
    with live.http() as http:
        with http.stream("POST", "/v1/completions", json=body, headers=auth("c18")) as a:
            lines = a.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: ") :])["choices"]  # A is running
            assert a.headers["x-ratelimit-remaining-requests"] == "1"
            b = _complete(http, "c18")
            assert b.status_code == 429
            assert b.json()["error"]["code"] == "concurrency_limit_exceeded"
            assert b.headers["retry-after"] == "1" and b.headers["retry-after-ms"] == "1000"
            assert b.headers["x-ratelimit-remaining-requests"] == "1"  # B took nothing
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # A done
        stats = ctx_of(live).qos.admission.stats
        assert live.wait_until(lambda: stats("c18").num_running == 0)
        c = _complete(http, "c18")
        assert c.status_code == 200
        assert c.headers["x-ratelimit-remaining-requests"] == "0"
    value = scrape(live)
    assert value("sits:tenant_ratelimit_used", tenant="c18", dimension="requests") == 2
    assert value("sits:tenant_ratelimit_remaining", tenant="c18", dimension="requests") == 0
    assert value("sits:tenant_admitted_requests_total", tenant="c18") == 2
    assert value("sits:tenant_rejected_requests_total", tenant="c18", reason="concurrency") == 1
    assert value("sits:tenant_requests_total", tenant="c18", outcome="ok") == 2
    assert value("sits:tenant_requests_total", tenant="c18", outcome="429") == 1


def test_c19_retry_after_matches_the_window(live, clock) -> None:
    with live.http() as http:
        assert _complete(http, "c19").status_code == 200
        assert _complete(http, "c19").status_code == 200
        refused = _complete(http, "c19")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        # 2 requests a minute: one comes back every 30 s; the bucket is full again in 60 s.
        assert refused.headers["retry-after"] == "30"
        assert refused.headers["retry-after-ms"] == "30000"
        assert refused.headers["x-ratelimit-limit-requests"] == "2"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"] == "1m0s"
        clock.advance(29.999)
        early = _complete(http, "c19")
        assert early.status_code == 429 and early.headers["retry-after-ms"] == "1"
        assert early.headers["retry-after"] == "1"  # integer seconds, at least 1
        clock.advance(0.001)
        assert _complete(http, "c19").status_code == 200
    assert scrape(live)("sits:tenant_requests_total", tenant="c19", outcome="429") == 2


def test_ratelimit_headers_on_200_streamed_or_not(live) -> None:
    with live.http() as http:
        num_prompt = len(live.engine.tokenizer.encode(PROMPT))
        whole = _complete(http, "limited", max_tokens=5, ignore_eos=True)
        assert whole.status_code == 200
        used = num_prompt + 5
        expected = {
            "x-ratelimit-limit-requests": "10",
            "x-ratelimit-remaining-requests": "9",
            "x-ratelimit-reset-requests": "6s",  # one request refills in 60 / 10 s
            "x-ratelimit-limit-tokens": "10000",
            "x-ratelimit-remaining-tokens": str(10_000 - used),
            "x-ratelimit-reset-tokens": format_reset(used * 60 / 10_000),
            "x-sits-overload-state": "green",
        }
        assert {k: whole.headers[k] for k in expected} == expected
        body = {"prompt": PROMPT, "max_tokens": 7, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body, headers=auth("limited")) as resp:
            assert resp.status_code == 200
            # Sent with the first byte: the stream's reservation (prompt + max_tokens) is held.
            assert resp.headers["x-ratelimit-remaining-requests"] == "8"
            held = used + num_prompt + 7
            assert resp.headers["x-ratelimit-remaining-tokens"] == str(10_000 - held)
            list(resp.iter_lines())
        stats = ctx_of(live).qos.admission.stats
        assert live.wait_until(lambda: stats("limited").num_running == 0)
        after = http.get("/v1/models", headers=auth("limited"))
        # Reconciled: the stream used prompt + 7 tokens, exactly what it reserved.
        assert after.headers["x-ratelimit-remaining-tokens"] == str(10_000 - held)
        assert after.headers["x-ratelimit-remaining-requests"] == "8"
        plain = _complete(http, "gold")
        assert plain.status_code == 200 and "x-ratelimit-limit-requests" not in plain.headers


def test_tokens_are_reconciled_with_real_usage(live) -> None:
    vocab_size = live.engine.engine_core.runner.model.arch.vocab_size
    num_prompt = len(live.engine.tokenizer.encode(PROMPT))
    with live.http() as http:
        before = http.get("/v1/models", headers=auth("limited")).headers
        # 50 completion tokens are reserved, but every token id stops: 1 is generated.
        out = _complete(http, "limited", max_tokens=50, stop_token_ids=list(range(vocab_size)))
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 1
    remaining = int(before["x-ratelimit-remaining-tokens"]) - (num_prompt + 1)
    assert out.headers["x-ratelimit-remaining-tokens"] == str(remaining)


def test_a_disconnect_releases_the_ticket_and_refunds_unused_tokens(live) -> None:
    num_prompt = len(live.engine.tokenizer.encode(PROMPT))
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with live.http() as http:
        with http.stream("POST", "/v1/completions", json=body, headers=auth("drop")) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data: "))
            held = int(resp.headers["x-ratelimit-remaining-tokens"])
            assert held == 100_000 - num_prompt - 500
        # The client went away after one chunk: the engine request is aborted.
        stats = ctx_of(live).qos.admission.stats
        assert live.wait_until(lambda: stats("drop").num_running == 0)
        after = _complete(http, "drop")  # the concurrency slot is free again
    assert after.status_code == 200
    remaining = int(after.headers["x-ratelimit-remaining-tokens"])
    used_by_after = after.json()["usage"]["total_tokens"]
    # Refunded: the stream was charged its prompt and the tokens made before the abort only.
    assert 100_000 - num_prompt - 500 < remaining + used_by_after <= 100_000 - num_prompt - 1
    assert scrape(live)("sits:tenant_requests_total", tenant="drop", outcome="abort") == 1


def test_per_request_limits_are_400_naming_the_param(live) -> None:
    with live.http() as http:
        too_many = _complete(http, "small", max_tokens=9)
        long_prompt = _complete(http, "small", prompt=list(range(5, 26)), max_tokens=2)
        fits = _complete(http, "small", prompt=list(range(5, 25)), max_tokens=8)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "max_tokens"
    assert too_many.json()["error"]["code"] == "max_tokens_per_request"
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    assert fits.status_code == 200
    assert scrape(live)("sits:tenant_requests_total", tenant="small", outcome="400") == 2


def test_a_chats_per_request_400_names_the_chats_own_fields(live) -> None:
    long_chat = [{"role": "user", "content": "Tell me a long story about the sea. " * 4}]
    short_chat = [{"role": "user", "content": "hi"}]
    with live.http() as http:
        replies = [
            http.post("/v1/chat/completions", json=body, headers=auth("small"))
            for body in (
                {"messages": short_chat, "max_completion_tokens": 9},
                {"messages": short_chat, "max_tokens": 9},
                {"messages": long_chat, "max_tokens": 2},
            )
        ]
    assert [r.status_code for r in replies] == [400, 400, 400]
    params = [r.json()["error"]["param"] for r in replies]
    assert params == ["max_completion_tokens", "max_tokens", "messages"]


def test_an_unset_max_tokens_takes_the_tenants_limit(live) -> None:
    """OpenAI's clients leave max_tokens out: for chat (and a null max_tokens in completions)
    it stands for the rest of the context, which a tenant's max_tokens_per_request (8 here)
    would refuse; it is capped at the limit shared by the request's sequences instead."""
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "temperature": 0, "ignore_eos": True}
    with live.http() as http:
        chat = http.post("/v1/chat/completions", json=body, headers=auth("small"))
        chat_n2 = http.post("/v1/chat/completions", json={**body, "n": 2}, headers=auth("small"))
        batch = _complete(http, "small", prompt=[[5, 6], [7, 8]], max_tokens=None, ignore_eos=True)
        n9 = http.post("/v1/chat/completions", json={**body, "n": 9}, headers=auth("small"))
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 8
    assert chat_n2.status_code == 200 and chat_n2.json()["usage"]["completion_tokens"] == 2 * 4
    assert batch.status_code == 200 and batch.json()["usage"]["completion_tokens"] == 2 * 4
    # Nine samples cannot share 8 tokens: one each is still over the limit, and says so.
    assert n9.status_code == 400 and n9.json()["error"]["code"] == "max_tokens_per_request"
    assert n9.json()["error"]["message"].startswith("The request may generate up to 9 tokens")


def test_an_unset_max_tokens_fits_the_tenants_tokens_per_minute(live) -> None:
    """Admission reserves prompt + max_tokens from the tokens-per-minute bucket, so an unset
    max_tokens (the rest of the 1,024-token context) would be refused with 400 by a tenant of
    120 tokens a minute; it stands for what the bucket holds beside the prompt instead."""
    body = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    with live.http() as http:
        chat = http.post("/v1/chat/completions", json=body, headers=auth("metered"))
        again = http.post("/v1/chat/completions", json=body, headers=auth("metered"))
    usage = chat.json()["usage"]
    assert chat.status_code == 200 and usage["total_tokens"] == 120
    assert chat.json()["choices"][0]["finish_reason"] == "length"
    assert again.status_code == 429  # the minute's tokens are spent (the clock stands still)
    assert again.json()["error"]["code"] == "rate_limit_exceeded"


def test_default_max_tokens_cap_takes_the_tighter_limit_per_sequence() -> None:
    assert default_max_tokens_cap(None, 3, 50) is None
    assert default_max_tokens_cap(tenant("free"), 3, 50) is None
    both = tenant("both", max_tokens_per_request=100, tokens_per_minute=250)
    assert default_max_tokens_cap(both, 1, 10) == 100  # max_tokens_per_request binds
    assert default_max_tokens_cap(both, 2, 170) == 40  # (250 - 170) // 2
    assert default_max_tokens_cap(both, 4, 250) == 1  # nothing left: admission refuses it


def test_refused_bodies_count_for_their_tenant(live) -> None:
    """A body refused before the handler runs is the 400 of the key's tenant; without a
    known key it is the 401 any other body would get, and no tenant's."""
    bad_json = b'{"model":'
    json_type = {"Content-Type": "application/json"}
    with live.http() as http:
        statuses = [
            http.post(
                "/v1/completions", content=bad_json, headers={**json_type, **auth("sloppy")}
            ).status_code,
            _complete(http, "sloppy", temperature="abc").status_code,
            http.post("/v1/chat/completions", json=[1], headers=auth("sloppy")).status_code,
            _complete(http, "sloppy", model="nope").status_code,
        ]
        unknown = http.post(
            "/v1/completions",
            content=bad_json,
            headers={**json_type, "Authorization": "Bearer not-a-key"},
        )
    assert statuses == [400, 400, 400, 404]
    assert unknown.status_code == 401
    assert unknown.json()["error"]["code"] == "invalid_api_key"
    value = scrape(live)
    assert value("sits:tenant_requests_total", tenant="sloppy", outcome="400") == 3
    assert value("sits:tenant_requests_total", tenant="sloppy", outcome="404") == 1
    assert value("sits:tenant_requests_total", tenant="sloppy", outcome="ok") == 0


def test_c19_official_client_retries_after_retry_after(tiny_moe_dir) -> None:
    tenants = TenantsConfig((tenant("c19", requests_per_minute=1),))
    settings = ServerSettings(tenants=tenants, qos=QosSettings(rate_limit_period_s=2.0))
    with LiveServer(tenant_engine(tiny_moe_dir, tenants), settings) as live, live.http() as http:
        assert _complete(http, "c19", max_tokens=1).status_code == 200
        refused = _complete(http, "c19", max_tokens=1)
        assert refused.status_code == 429
        # One request per 2 s window: the wait is under 2 s, rounded up to whole seconds.
        assert 1 <= int(refused.headers["retry-after"]) <= 2
        assert 0 < int(refused.headers["retry-after-ms"]) <= 2000
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key=key_of("c19"), max_retries=2)
        out = client.completions.create(model=live.engine.model_name, prompt=PROMPT, max_tokens=1)
        assert out.usage.completion_tokens == 1
        stats = ctx_of(live).qos.admission.stats("c19")
        # Refused once by hand and once by the client, which then waited and got through.
        assert stats.num_rejected == {"requests": 2} and stats.num_admitted == 2
