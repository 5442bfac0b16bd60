"""`ReceivedAtMiddleware`: the receipt stamp and the `openai-processing-ms` header."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from sits.server import request_tracing
from sits.server.request_tracing import RECEIVED_STATE_KEY, ReceivedAtMiddleware


def _run(scope: dict, clock: list[float], monkeypatch) -> tuple[list[dict], dict]:
    """Call the middleware around an app that answers 200 with one header; `clock` holds the
    successive `time.monotonic()` values. Returns (messages sent, the scope the app saw)."""
    ticks = iter(clock)
    monkeypatch.setattr(request_tracing, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    seen: dict = {}

    async def app(scope, receive, send) -> None:
        seen.update(scope)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict] = []

    async def send(message) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    asyncio.run(ReceivedAtMiddleware(app)(scope, receive, send))
    return sent, seen


def test_processing_ms_is_the_time_from_receipt_to_the_response_start(monkeypatch) -> None:
    sent, seen = _run({"type": "http"}, [100.0, 100.2509], monkeypatch)
    assert seen["state"][RECEIVED_STATE_KEY] == 100.0
    start, body = sent
    assert start["headers"] == [(b"content-type", b"text/plain"), (b"openai-processing-ms", b"250")]
    assert start["status"] == 200 and body == {"type": "http.response.body", "body": b"ok"}


def test_other_scopes_pass_untouched(monkeypatch) -> None:
    sent, seen = _run({"type": "websocket"}, [], monkeypatch)  # the clock is never read
    assert "state" not in seen
    assert sent[0]["headers"] == [(b"content-type", b"text/plain")]


@pytest.mark.parametrize(
    ("body", "status"),
    [({"prompt": "hi", "max_tokens": 2, "stream": True}, 200), ({"prompt": 5}, 400)],
)
def test_a_live_server_sends_it_on_streams_and_errors(server, model_name, body, status) -> None:
    with httpx.stream("POST", server.base_url + "/v1/completions",
                      json={"model": model_name, **body}) as response:  # fmt: skip
        assert response.status_code == status
        assert 0 <= int(response.headers["openai-processing-ms"]) < 60_000
        response.read()
