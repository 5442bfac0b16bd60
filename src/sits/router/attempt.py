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

import aiohttp
from multidict import CIMultiDictProxy

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
        upstream: the open upstream response of a stream (`close_upstream` it), else None.
        first_chunk: a stream's first body bytes (already read), else b"".
        chunks: the rest of a stream's raw body, as it arrives.
    """

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes | None = None
    upstream: aiohttp.ClientResponse | None = None
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None


def close_upstream(upstream: aiohttp.ClientResponse, whole: bool) -> None:
    """End a stream's upstream response: back to the pool when it was read to its end, else
    the connection is closed (the replica sees the client go and aborts the request)."""
    if whole:
        upstream.release()
    else:
        upstream.close()


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
    session: aiohttp.ClientSession,
    url: str,
    content: bytes,
    headers: Mapping[str, str],
    *,
    first_byte_timeout_s: float,
) -> Answer | Failure:
    """POST `content` to `url` and wait for the answer's first body byte.

    Args:
        session: the pooled client session.
        url: the replica's URL with the route's path.
        content: the request body as the client sent it (or as the router rewrote it).
        headers: headers for the replica.
        first_byte_timeout_s: seconds to wait for the first body byte (a non-streamed answer:
            for the whole answer); also the longest silence between two reads of a stream.

    Returns:
        The answer, or the failure to retry elsewhere.
    """
    timeout = aiohttp.ClientTimeout(
        total=None, connect=_CONNECT_TIMEOUT_S, sock_read=first_byte_timeout_s
    )
    try:
        upstream = await session.post(url, data=content, headers=headers, timeout=timeout)
    except TimeoutError:
        return Failure("timeout", f"no answer from {url} in {first_byte_timeout_s:g} s")
    except aiohttp.ClientConnectorError as exc:
        return Failure("connect", f"{url}: {type(exc).__name__}: {exc}")
    except aiohttp.ClientError as exc:
        return Failure("read", f"{url}: {type(exc).__name__}: {exc}")
    try:
        if upstream.content_type != "text/event-stream" or upstream.status != 200:
            body = await asyncio.wait_for(upstream.read(), first_byte_timeout_s)
            upstream.release()
            if upstream.status == 503:
                code = error_code(body)
                if code in RETRYABLE_503_CODES:
                    return Failure(code, f"{url} answered 503 {code}")
            return Answer(upstream.status, upstream.headers, body=body)
        first = await asyncio.wait_for(upstream.content.readany(), first_byte_timeout_s)
        if not first:
            upstream.close()
            return Failure("read", f"{url} ended its stream before its first byte")
    except TimeoutError:
        upstream.close()
        return Failure("timeout", f"{url} sent no first byte in {first_byte_timeout_s:g} s")
    except aiohttp.ClientError as exc:
        upstream.close()
        return Failure("read", f"{url} broke off before its first byte ({type(exc).__name__})")
    except BaseException:
        upstream.close()
        raise
    return Answer(
        200, upstream.headers, upstream=upstream, first_chunk=first, chunks=_chunks(upstream)
    )


async def _chunks(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The rest of a stream's body, each chunk as soon as it arrives."""
    async for chunk in upstream.content.iter_any():
        yield chunk
