"""The benchmark's HTTP client: one streamed OpenAI request, timed chunk by chunk.

Works against any OpenAI-compatible server (sits, vLLM, ...): it sends `stream: true` with
`stream_options.include_usage` (optional) and reads server-sent events (`data: {json}` lines up
to `data: [DONE]`). A token chunk is one with choices, as vLLM's benchmark counts them: its
text may be "" (a special token, a partial character: servers such as vLLM and sits still
send a chunk for it); a chat chunk whose delta carries only the role, and a usage-only chunk
(no choices), are not token chunks. Timing, on `time.perf_counter`:
- TTFT: send -> first token chunk; ITL: each gap between consecutive token chunks;
- E2E: send -> end of stream (`[DONE]`), or -> the failure;
- connect, sent: send -> TCP connection up, send -> request body written (httpcore's trace);
- processing: the server's `openai-processing-ms` header, where it sends one;
- output tokens: `usage.completion_tokens` of the last usage seen, else the token chunks.
Any failure (HTTP status != 200, an error event in the stream, a stream cut before `[DONE]`,
a connection error or timeout, unparsable data) is recorded in the `RequestRecord`, never
raised: one bad request must not end a run.
httpx logs every request at INFO; `make_client` raises its (and httpcore's) loggers to WARNING
so a run does not print one line per request on stderr.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from sits.bench.records import RequestRecord

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)
_MAX_ERROR_CHARS = 300
HTTP_LOGGERS = ("httpx", "httpcore")
PROCESSING_MS_HEADER = "openai-processing-ms"  # OpenAI's and sits': receipt -> response start
STREAM_CUT_ERROR = "the stream ended without [DONE]"  # `RequestRecord.error` of a cut stream


def _processing_s(value: str | None) -> float | None:
    """The `openai-processing-ms` header in seconds; None when absent or not a number."""
    try:
        return float(value) / 1000.0 if value is not None else None
    except ValueError:
        return None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """`Authorization: Bearer KEY` when a key is given, else no header."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def quiet_http_logs() -> None:
    """Set the httpx and httpcore loggers to WARNING (at INFO httpx logs every request)."""
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def make_client(timeout_s: float) -> httpx.AsyncClient:
    """An async client without a connection cap (httpx's default of 100 would silently bound
    the concurrency), keeping no idle connections, and with `timeout_s` for connect, read,
    write and pool waits; the HTTP libraries' per-request logs are silenced
    (`quiet_http_logs`).

    No keep-alive: httpcore's pool (1.0) walks every connection for each idle one whenever a
    request starts or ends, so thousands of connections left idle (e.g. after a flood of 503s)
    took 12-100 ms per event and stalled the client's own loop for seconds, which showed as
    zero-token seconds and late sends (measured with a server that never stalls). One new
    TCP connection per request costs far less at benchmark rates."""
    quiet_http_logs()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)


def build_body(
    endpoint: str,
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    *,
    stream: bool = True,
    ignore_eos: bool = False,
    stream_usage: bool = True,
) -> dict[str, Any]:
    """The JSON body of one request, greedy (temperature 0) as serving benchmarks use.

    Args:
        endpoint: `/v1/completions` (text or token-id prompt) or `/v1/chat/completions`
            (text only: one user message).
        ignore_eos: send vLLM's `ignore_eos` extra so exactly `max_tokens` are generated.
        stream_usage: ask for the usage chunk (`stream_options.include_usage`).
    """
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    if endpoint == CHAT_COMPLETIONS:
        assert isinstance(prompt, str), "chat prompts are text"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        if stream_usage:
            body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def error_message(raw: bytes) -> str:
    """The `error.message` of an OpenAI error body, else the body's start."""
    text = raw.decode("utf-8", errors="replace")
    try:
        payload = json.loads(text)
    except ValueError:
        return text[:_MAX_ERROR_CHARS]
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:_MAX_ERROR_CHARS]
        if err is not None:
            return str(err)[:_MAX_ERROR_CHARS]
    return text[:_MAX_ERROR_CHARS]


def is_token_chunk(payload: dict[str, Any]) -> bool:
    """True for a streamed chunk that carries generated tokens (see the module docstring)."""
    for choice in payload.get("choices") or ():
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" not in delta or delta.get("content"):
            return True
    return False


def _apply_usage(record: RequestRecord, payload: dict[str, Any]) -> bool:
    usage = payload.get("usage")
    if not isinstance(usage, dict):
        return False
    if usage.get("prompt_tokens") is not None:
        record.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
        return True
    return False


async def _read_stream(response: httpx.Response, record: RequestRecord, t0: float) -> bool:
    """Consume the event stream into `record`; True when it ended with `[DONE]`."""
    last_s: float | None = None
    have_usage = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        payload = json.loads(data)
        if not isinstance(payload, dict):
            raise ValueError(f"unexpected event {data[:80]!r}")
        if payload.get("error") is not None:
            record.error = error_message(data.encode())
            return False
        have_usage = _apply_usage(record, payload) or have_usage
        if is_token_chunk(payload):
            now = time.perf_counter()
            if last_s is None:
                record.ttft_s = now - t0
            else:
                record.itl_s.append(now - last_s)
            last_s = now
            record.num_chunks += 1
            if not have_usage:
                record.output_tokens = record.num_chunks
    record.error = STREAM_CUT_ERROR
    return False


async def send_streaming(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    record: RequestRecord,
    run_start_s: float,
) -> None:
    """Send one streamed request and fill `record` with what happened (never raises, except
    `asyncio.CancelledError`).

    Args:
        url: the endpoint's full URL.
        run_start_s: `time.perf_counter()` at the run's start (for `record.start_s`).
    """
    t0 = time.perf_counter()
    record.start_s = t0 - run_start_s

    async def trace(event: str, info: dict[str, Any]) -> None:  # httpcore's trace extension
        if event == "connection.connect_tcp.complete":
            record.connect_s = time.perf_counter() - t0
        elif event == "http11.send_request_body.complete":
            record.sent_s = time.perf_counter() - t0

    try:
        async with client.stream(
            "POST", url, json=body, headers=headers, extensions={"trace": trace}
        ) as response:
            record.status = response.status_code
            record.processing_s = _processing_s(response.headers.get(PROCESSING_MS_HEADER))
            if response.status_code != 200:
                record.error = error_message(await response.aread())
            else:
                record.ok = await _read_stream(response, record, t0)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
    except ValueError as exc:  # unparsable event data (json.JSONDecodeError is a ValueError)
        record.error = f"bad event data: {exc}"[:_MAX_ERROR_CHARS]
    record.e2e_s = time.perf_counter() - t0
    if not record.ok and record.error is None:
        record.error = "failed"
