"""When the server received each HTTP request.

`ReceivedAtMiddleware` is the outermost middleware: its first act on an HTTP request is to
store `time.monotonic()` in the request state under `RECEIVED_STATE_KEY`, before the body is
read or parsed and before any other middleware runs. Times measured from it (the per-tenant
TTFT from receipt, `sits:tenant_http_time_to_first_token_seconds`) therefore include the HTTP
process's own work and queueing (parsing, validation, tokenization, admission), which the
engine's TTFT, measured from the hand-off to the engine, leaves out.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

RECEIVED_STATE_KEY = "sits_received_s"


class ReceivedAtMiddleware:
    """Stamps each HTTP request's receipt time (see the module docstring).

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})[RECEIVED_STATE_KEY] = time.monotonic()
        await self.app(scope, receive, send)


def received_at(request: Request) -> float | None:
    """The request's receipt time (time.monotonic() seconds), None when it did not pass
    through `ReceivedAtMiddleware`."""
    return (request.scope.get("state") or {}).get(RECEIVED_STATE_KEY)
