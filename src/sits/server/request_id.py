"""`RequestIdMiddleware`: the `x-request-id` and 503 `Retry-After` headers of every response.

Every HTTP response carries `x-request-id`: the client's own `x-request-id` when it sent one
(echoed as sent), else the response's id (`cmpl-...`, `chatcmpl-...`, set by the generation
routes with `set_response_id`), else a fresh random id (errors before a job exists, /health,
/v1/models). Every 503 (draining, overload shedding, an open breaker, a dead or stalled
engine) carries `Retry-After`: a route's own value is kept, any other 503 gets
`DEFAULT_RETRY_AFTER_S`. Pure ASGI, so streamed responses pass through untouched after their
start message.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"
RETRY_AFTER_HEADER = b"retry-after"
DEFAULT_RETRY_AFTER_S = 1  # the engine or the server will be back, or another replica takes it
_RESPONSE_ID_KEY = "sits_response_id"


def set_response_id(request: Request, response_id: str) -> None:
    """Name the response's id (the body's `id`) as this request's `x-request-id`."""
    request.scope.setdefault("state", {})[_RESPONSE_ID_KEY] = response_id


class RequestIdMiddleware:
    """Adds `x-request-id` to every response and `Retry-After` to every 503 (see the module
    docstring).

    Args:
        app: the wrapped ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = next(
            (value for name, value in scope.get("headers", ()) if name == REQUEST_ID_HEADER), None
        )
        state = scope.setdefault("state", {})

        async def send_with_ids(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                names = {name.lower() for name, _ in headers}
                if REQUEST_ID_HEADER not in names:
                    response_id = state.get(_RESPONSE_ID_KEY)
                    value = client_id or (response_id or uuid.uuid4().hex).encode("latin-1")
                    headers.append((REQUEST_ID_HEADER, value))
                if message["status"] == 503 and RETRY_AFTER_HEADER not in names:
                    headers.append((RETRY_AFTER_HEADER, str(DEFAULT_RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_ids)
