"""Protocol details of issue 29: `x-request-id` on every response, `Retry-After` on every
503, /version, and temperature above 2 refused as OpenAI does."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

import sits
from sits.server.request_id import RequestIdMiddleware, set_response_id


def _unit_app() -> TestClient:
    async def plain_503(request):
        return JSONResponse({}, status_code=503)

    async def own_retry(request):
        return JSONResponse({}, status_code=503, headers={"Retry-After": "7"})

    async def with_id(request):
        set_response_id(request, "cmpl-42")
        return JSONResponse({"id": "cmpl-42"})

    routes = [Route("/a", plain_503), Route("/b", own_retry), Route("/c", with_id)]
    app = Starlette(routes=routes)
    app.add_middleware(RequestIdMiddleware)
    return TestClient(app)


def test_middleware_headers() -> None:
    client = _unit_app()
    first = client.get("/a")
    assert first.headers["retry-after"] == "1"
    assert len(first.headers["x-request-id"]) == 32  # a fresh uuid4 hex
    assert client.get("/a").headers["x-request-id"] != first.headers["x-request-id"]
    assert client.get("/b").headers.get_list("retry-after") == ["7"]
    assert client.get("/c").headers["x-request-id"] == "cmpl-42"
    assert client.get("/c", headers={"x-request-id": "mine"}).headers["x-request-id"] == "mine"
    assert "retry-after" not in client.get("/c").headers


def test_client_request_id_is_echoed_everywhere(server, model_name) -> None:
    mine = {"x-request-id": "trace-123"}
    with server.http() as http:
        ok = http.post("/v1/completions", headers=mine, json={"prompt": "hi", "max_tokens": 2})
        bad = http.post("/v1/completions", headers=mine, json={"prompt": "hi", "n": 0})
        for resp in (
            ok,
            bad,
            http.get("/health", headers=mine),
            http.get("/v1/models", headers=mine),
        ):
            assert resp.headers["x-request-id"] == "trace-123", resp.url
        assert bad.status_code == 400


def test_response_id_is_the_request_id_without_one(server, model_name) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert resp.headers["x-request-id"] == resp.json()["id"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp = http.post("/v1/chat/completions", json=chat)
        assert resp.headers["x-request-id"] == resp.json()["id"]
        assert resp.json()["id"].startswith("chatcmpl-")
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as s:
            first = next(line for line in s.iter_lines() if line.startswith("data: {"))
            assert s.headers["x-request-id"] == json.loads(first[6:])["id"]


def test_client_sees_the_header_through_the_openai_sdk(client, model_name) -> None:
    raw = client.completions.with_raw_response.create(
        model=model_name, prompt="hi", max_tokens=2, extra_headers={"x-request-id": "sdk-1"}
    )
    assert raw.headers["x-request-id"] == "sdk-1"
    assert raw.parse().choices[0].finish_reason in ("length", "stop")


def test_a_503_of_the_engine_has_retry_after(server, monkeypatch) -> None:
    """/health's "engine_stalled" 503 sets no Retry-After of its own: the middleware adds it
    (a dead engine's 503 takes the same path; faking one here would end the shared server)."""
    with server.http() as http:
        monkeypatch.setattr(server.engine, "stall_reason", lambda: "stalled")
        resp = http.get("/health")
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        monkeypatch.setattr(server.engine, "stall_reason", lambda: None)
        assert "retry-after" not in http.get("/health").headers


def test_version(server) -> None:
    with server.http() as http:
        assert http.get("/version").json() == {"version": sits.__version__}


@pytest.mark.parametrize("temperature", [2.0000001, 3, 1e9])
def test_temperature_above_two_is_refused(client, model_name, temperature) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="hi", temperature=temperature)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "hi"}], temperature=temperature
        )
    assert err.value.body["param"] == "temperature"
    ok = client.completions.create(model=model_name, prompt="hi", temperature=2, max_tokens=2)
    assert len(ok.choices) == 1
