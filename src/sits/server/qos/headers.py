"""ASGI middleware adding the QoS headers to every response, streamed ones included.

At `http.response.start` it adds, unless the response already has them:
- `x-sits-overload-state: green | yellow | red` (every response);
- the authenticated tenant's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` (a
  tenant with rate limits; the values are read at that moment, so a non-streamed answer shows
  its reconciled tokens and a stream shows them as of its first byte).
The tenant is what `admit.require_tenant` stored in the request state under `TENANT_STATE_KEY`.
Responses of unexpected exceptions (500 from Starlette's outermost error middleware) do not
pass through here; the serving code turns engine failures into `ServerError`s so they do.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sits.admission import OVERLOAD_HEADER
from sits.server.qos.admit import TENANT_STATE_KEY, ServerQos


class QosHeadersMiddleware:
    """Adds the overload state and the tenant's rate-limit headers (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        qos: the server's QoS state.
    """

    def __init__(self, app: ASGIApp, qos: ServerQos) -> None:
        self.app = app
        self.qos = qos

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._add_headers(scope, message)
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _add_headers(self, scope: Scope, message: Message) -> None:
        headers = MutableHeaders(scope=message)
        if OVERLOAD_HEADER not in headers:
            headers.append(OVERLOAD_HEADER, self.qos.overload_state.value)
        tenant = (scope.get("state") or {}).get(TENANT_STATE_KEY)
        if tenant is None:
            return
        for name, value in self.qos.ratelimit_headers(tenant).items():
            if name not in headers:
                headers.append(name, value)
