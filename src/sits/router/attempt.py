"""One attempt of a request on one replica: send it, wait for its first response byte, classify.

`send_attempt` returns an `Answer` (the replica answered: a status and, for a stream, the open
upstream response with its first body chunk already read) or a `Failure` (nothing reached the
client, so the request may go to another replica). What counts as a failure that may be retried
(the issue's list): a refused or reset connection, a time-out before the first byte, a read that
broke before the answer was whole (a non-streamed answer is held until whole, so its client has
seen nothing either), and 503 with code `draining` or `engine_dead`. Other statuses, 5xx
included, are answers: the replica spoke, and the client gets its words.
`Failure.counts_against_replica` says whether the replica's breaker counts it (draining is an
orderly goodbye, not a fault).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx

RETRYABLE_503_CODES = frozenset({"draining", "engine_dead"})
_CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Failure:
    """An attempt that may be retried elsewhere.

    Attributes:
        kind: "connect", "timeout", "read", "draining" or "engine_dead" (metric label).
        message: what happened, for the log and the client's final 503.
    """

    kind: str
    message: str

    @property
    def counts_against_replica(self) -> bool:
        """True when the replica's circuit breaker counts this failure."""
        return self.kind != "draining"


@dataclass(slots=True)
class Answer:
    """A replica's answer.

    Attributes:
        status: HTTP status.
        headers: the replica's response headers.
        body: the whole body (not streamed), else None.
        upstream: the open upstream response of a stream (close it), else None.
        first_chunk: a stream's first body bytes (already read), else b"".
        chunks: the rest of a stream's raw body.
    """

    status: int
    headers: httpx.Headers
    body: bytes | None = None
    upstream: httpx.Response | None = None
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None


def error_code(body: bytes) -> str | None:
    """The `error.code` of an OpenAI error body, or None."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if isinstance(parsed, Mapping) and isinstance(parsed.get("error"), Mapping):
        code = parsed["error"].get("code")
        return code if isinstance(code, str) else None
    return None


async def send_attempt(
    client: httpx.AsyncClient,
    url: str,
    content: bytes,
    headers: Mapping[str, str],
    *,
    first_byte_timeout_s: float,
) -> Answer | Failure:
    """POST `content` to `url` and wait for the answer's first body byte.

    Args:
        client: the pooled client.
        url: the replica's URL with the route's path.
        content: the request body as the client sent it (or as the router rewrote it).
        headers: headers for the replica.
        first_byte_timeout_s: seconds to wait for the first body byte (a non-streamed answer:
            for the whole answer).

    Returns:
        The answer, or the failure to retry elsewhere.
    """
    timeout = httpx.Timeout(first_byte_timeout_s, connect=_CONNECT_TIMEOUT_S)
    request = client.build_request("POST", url, content=content, headers=headers, timeout=timeout)
    try:
        upstream = await client.send(request, stream=True)
    except httpx.TimeoutException as exc:
        return Failure("timeout", f"no answer from {url} in time ({type(exc).__name__})")
    except httpx.HTTPError as exc:
        kind = "connect" if isinstance(exc, httpx.ConnectError) else "read"
        return Failure(kind, f"{url}: {type(exc).__name__}: {exc}")
    is_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
    try:
        if not is_stream or upstream.status_code != 200:
            body = await asyncio.wait_for(upstream.aread(), first_byte_timeout_s)
            await upstream.aclose()
            if upstream.status_code == 503:
                code = error_code(body)
                if code in RETRYABLE_503_CODES:
                    return Failure(code, f"{url} answered 503 {code}")
            return Answer(upstream.status_code, upstream.headers, body=body)
        chunks = upstream.aiter_raw()
        first = b""
        while not first:  # an empty chunk is no byte
            first = await asyncio.wait_for(anext(chunks), first_byte_timeout_s)
    except (TimeoutError, httpx.TimeoutException):
        await upstream.aclose()
        return Failure("timeout", f"{url} sent no first byte in {first_byte_timeout_s:g} s")
    except (httpx.HTTPError, StopAsyncIteration) as exc:
        await upstream.aclose()
        return Failure("read", f"{url} broke off before its first byte ({type(exc).__name__})")
    except BaseException:
        await upstream.aclose()
        raise
    return Answer(200, upstream.headers, upstream=upstream, first_chunk=first, chunks=chunks)
