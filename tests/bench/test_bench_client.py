"""The streaming client on canned server answers (httpx.MockTransport): SSE parsing, token
counts, and failures recorded, never raised."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import httpx

from sits.bench.client import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    HTTP_LOGGERS,
    build_body,
    is_token_chunk,
    make_client,
    send_streaming,
)
from sits.bench.records import RequestRecord


def _sse(*events: dict | str) -> bytes:
    frames = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(frames).encode()


def _text(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": None}


def _run(handler: Callable[[httpx.Request], httpx.Response]) -> tuple[RequestRecord, dict]:
    seen: dict = {}

    def wrapped(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["auth"] = request.headers.get("authorization")
        return handler(request)

    record = RequestRecord(index=0, tenant="t", arrival_s=0.0, input_len=3, output_len=4)

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(wrapped)) as client:
            body = build_body(COMPLETIONS, "m", [5, 6, 7], 4, ignore_eos=True)
            headers = {"Authorization": "Bearer sk-x"}
            await send_streaming(client, "http://s/v1/completions", body, headers, record,
                                 time.perf_counter())  # fmt: skip

    asyncio.run(go())
    return record, seen


def test_stream_timings_and_usage_counts() -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    body = _sse(_text("a"), _text(""), _text("bc"), _text("d"), usage, "[DONE]")
    record, seen = _run(lambda req: httpx.Response(200, content=body))
    assert seen["body"] == {
        "model": "m", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    assert seen["auth"] == "Bearer sk-x"
    assert (record.ok, record.status, record.error) == (True, 200, None)
    # Four token chunks (one token decoded to ""); tokens from the usage chunk.
    assert (record.num_chunks, len(record.itl_s), record.output_tokens) == (4, 3, 4)
    assert record.prompt_tokens == 3
    assert 0 <= record.ttft_s <= record.e2e_s
    assert record.ttft_s + sum(record.itl_s) <= record.e2e_s


def test_without_usage_the_token_chunks_are_counted() -> None:
    # The middle token decodes to "": it still arrived (TTFT/ITL count it, as vLLM's client).
    body = _sse(_text("a"), _text(""), _text("b"), "[DONE]")
    record, _ = _run(lambda req: httpx.Response(200, content=body))
    assert (record.ok, record.output_tokens, record.prompt_tokens) == (True, 3, None)
    assert len(record.itl_s) == 2


def test_chat_chunks_skip_the_role_delta() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    word = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
    think = {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}
    empty = {"choices": [{"index": 0, "delta": {"content": ""}}]}  # a token without text
    usage = {"choices": [], "usage": {"completion_tokens": 1}}
    assert [is_token_chunk(c) for c in (role, word, think, empty, usage)] == [
        False, True, True, True, False
    ]  # fmt: skip
    body = build_body(CHAT_COMPLETIONS, "m", "hello", 2, stream_usage=False)
    assert body == {"model": "m", "max_tokens": 2, "temperature": 0.0, "stream": True,
                    "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip


def test_refusals_and_broken_streams_are_failed_records() -> None:
    limited = {"error": {"message": "Rate limit reached", "type": "rate_limit", "code": "429"}}
    record, _ = _run(lambda req: httpx.Response(429, json=limited, headers={"Retry-After": "1"}))
    assert (record.ok, record.status, record.error) == (False, 429, "Rate limit reached")
    record, _ = _run(lambda req: httpx.Response(503, text="overloaded"))
    assert (record.ok, record.status, record.error) == (False, 503, "overloaded")
    # An error event inside a 200 stream.
    body = _sse(_text("a"), {"error": {"message": "engine died"}})
    record, _ = _run(lambda req: httpx.Response(200, content=body))
    assert (record.ok, record.status, record.error, record.num_chunks) == (
        False, 200, "engine died", 1
    )  # fmt: skip
    # A stream cut before [DONE].
    record, _ = _run(lambda req: httpx.Response(200, content=_sse(_text("a"))))
    assert (record.ok, record.error) == (False, "the stream ended without [DONE]")
    # Garbage data.
    record, _ = _run(lambda req: httpx.Response(200, content=b"data: {nope\n\n"))
    assert not record.ok and record.error.startswith("bad event data")


def test_connection_errors_are_recorded_without_a_status() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    record, _ = _run(refuse)
    assert (record.ok, record.status) == (False, None)
    assert record.error == "ConnectError: connection refused"
    assert record.e2e_s is not None and record.ttft_s is None


def test_make_client_silences_httpx_request_logs(caplog) -> None:
    """httpx logs each request at INFO; the benchmark's client must not (one line per request
    on stderr)."""
    levels = {name: logging.getLogger(name).level for name in HTTP_LOGGERS}

    async def one_request(client: httpx.AsyncClient) -> None:
        async with client:
            await client.get("http://s/health")

    def mocked() -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(lambda _r: httpx.Response(200)))

    try:
        for name in HTTP_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)
        caplog.set_level(logging.INFO)
        asyncio.run(one_request(mocked()))
        assert [r.name for r in caplog.records] == ["httpx"]  # what users saw
        caplog.clear()
        asyncio.run(make_client(5.0).aclose())
        assert all(logging.getLogger(n).level == logging.WARNING for n in HTTP_LOGGERS)
        asyncio.run(one_request(mocked()))
        assert caplog.records == []
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
