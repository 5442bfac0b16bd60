"""Server-sent events: `data: {json}\\n\\n` frames, `data: [DONE]`, and a response that notices
a client going away.

`SSEResponse` sends the events of an async iterator while a second task waits for the ASGI
`http.disconnect` message; whichever ends first stops the other, and `on_close` runs in every
case (the handler closes its engine job there, which aborts the engine requests and frees their
KV blocks at once). A send that fails because the socket is gone counts as a disconnect.

Also `wait_for_disconnect` / `run_until_disconnect`, used by non-streamed handlers, which need
the same guarantee while they wait for the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was complete."""


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One `data:` frame holding `payload` as compact JSON."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client disconnected.

    Call only after the request body has been read (FastAPI reads it before the handler).
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first.

    Raises:
        ClientDisconnected: the client went away first (`work` was cancelled).
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watcher, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


class SSEResponse(Response):
    """A `text/event-stream` response fed by an async iterator of ready-made frames.

    Args:
        events: yields complete frames (see `sse_event`), as text or as UTF-8 bytes (the fleet
            router relays a replica's bytes as they came); the response ends when it ends.
        on_close: awaited exactly once when the response ends, however it ends.
    """

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[str | bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content=None, status_code=200, media_type=self.media_type)
        del self.headers["content-length"]  # streamed: chunked transfer, no fixed length
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"
        self._events = events
        self._on_close = on_close
        self.client_disconnected = False

    async def _send_all(self, send: Send) -> None:
        async for frame in self._events:
            body = frame if isinstance(frame, bytes) else frame.encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            streamer = asyncio.ensure_future(self._send_all(send))
            watcher = asyncio.ensure_future(wait_for_disconnect(receive))
            try:
                await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (streamer, watcher):
                    if not task.done():
                        task.cancel()
                await asyncio.gather(streamer, watcher, return_exceptions=True)
            if watcher.done() and not watcher.cancelled():
                self.client_disconnected = True
            elif not streamer.cancelled() and streamer.exception() is not None:
                exc = streamer.exception()
                if isinstance(exc, OSError):
                    self.client_disconnected = True
                else:
                    logger.error("stream failed", exc_info=exc)
        except OSError:
            self.client_disconnected = True
        finally:
            with contextlib.suppress(Exception):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            await self._on_close()
