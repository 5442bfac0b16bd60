"""When the server received each HTTP request.

`ReceivedAtMiddleware` is the outermost middleware: its first act on an HTTP request is to
store `time.monotonic()` in the request state under `RECEIVED_STATE_KEY`, before the body is
read or parsed and before any other middleware runs. Times measured from it (the per-tenant
TTFT from receipt, `sits:tenant_http_time_to_first_token_seconds`) therefore include the HTTP
process's own work and queueing (parsing, validation, tokenization, admission), which the
engine's TTFT, measured from the hand-off to the engine, leaves out.

Every response carries that time as OpenAI's `openai-processing-ms` header: the whole
milliseconds from receipt to the response's start. A stream starts with its first token (the
server waits for it, so that a refusal can still be an HTTP error), so there it is the TTFT
from receipt. A client's TTFT minus it is the time the request and its first bytes spent
outside the server's app: connecting, the listen queue, the network, the client itself.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

RECEIVED_STATE_KEY = "sits_received_s"
PROCESSING_MS_HEADER = "openai-processing-ms"


class ReceivedAtMiddleware:
    """Stamps each HTTP request's receipt time and adds `openai-processing-ms` to its response
    (see the module docstring).

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received_s = time.monotonic()
        scope.setdefault("state", {})[RECEIVED_STATE_KEY] = received_s

        async def send_with_processing_time(message: Message) -> None:
            if message["type"] == "http.response.start":
                ms = int((time.monotonic() - received_s) * 1000.0)
                headers = [*message.get("headers", ()), (PROCESSING_MS_HEADER.encode(), b"%d" % ms)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_processing_time)


def received_at(request: Request) -> float | None:
    """The request's receipt time (time.monotonic() seconds), None when it did not pass
    through `ReceivedAtMiddleware`."""
    return (request.scope.get("state") or {}).get(RECEIVED_STATE_KEY)
