"""`AuditRefusalMiddleware`: an audit record for every generation request answered with an
error (`--audit-log`), so the log accounts for every request a tenant sent.

Pure ASGI, installed only with an audit log, just inside the receipt stamp (so it sees every
status the app sends, the tracer's `traceparent` and the QoS headers included). For
`POST /v1/completions` and `/v1/chat/completions` (any method: a 405 is a refusal too) it
watches the response's start; when the status is 400 or more (but 499, the client's own
disconnect), it keeps the first `MAX_BODY_BYTES` of the body (an OpenAI error body) and, once
the response is sent, submits `ServerAudit.refused` with the status, the error's type, code,
param and message, the tenant the auth dependency stored (None for a 401) and the trace id.
A request the engine had started (`AUDITED_STATE_KEY`, set by the serving code, holds its job
id) already has its request records: its refusal record shares that id. An exception that
leaves the app before any response is audited as a 500 and re-raised.

Invariants: nothing is parsed or recorded for a successful answer; a refusal's record holds
no input and no output; a refusal is recorded at most once.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sits.obs.request_audit import AUDITED_STATE_KEY, ServerAudit
from sits.server.qos.admit import TENANT_STATE_KEY
from sits.server.serving_common import CLIENT_CLOSED_STATUS, GENERATION_ROUTES

MAX_BODY_BYTES = 16 * 1024


class AuditRefusalMiddleware:
    """Audits error answers to generation requests (see the module docstring).

    Args:
        app: the wrapped ASGI app.
        audit: the server's audit log.
    """

    def __init__(self, app: ASGIApp, audit: ServerAudit) -> None:
        self.app = app
        self.audit = audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_ROUTES:
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})  # one dict for every copy of the scope below
        seen = _Answer()

        async def watch(message: Message) -> None:
            seen.observe(message)
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException:
            if seen.status is None:
                seen.status = 500
                seen.error = {"type": "internal_server_error", "message": "unexpected error"}
            raise
        finally:
            if seen.is_refusal():
                self._record(scope, seen)

    def _record(self, scope: Scope, seen: _Answer) -> None:
        state = scope.get("state") or {}
        tenant = state.get(TENANT_STATE_KEY)
        assert seen.status is not None
        self.audit.refused(
            tenant_id=None if tenant is None else tenant.id,
            route=f"{scope.get('method', '?')} {scope.get('path')}",
            status=seen.status,
            error=seen.error_object(),
            job_id=state.get(AUDITED_STATE_KEY),
            trace_id=seen.trace_id,
        )


class _Answer:
    """What the middleware saw of one response."""

    __slots__ = ("body", "error", "status", "trace_id")

    def __init__(self) -> None:
        self.status: int | None = None
        self.body = b""
        self.error: dict[str, Any] | None = None
        self.trace_id: str | None = None

    def is_refusal(self) -> bool:
        return (
            self.status is not None and self.status >= 400 and self.status != CLIENT_CLOSED_STATUS
        )

    def observe(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            if self.is_refusal():
                self.trace_id = _trace_id(message.get("headers") or ())
        elif message["type"] == "http.response.body" and self.is_refusal():
            room = MAX_BODY_BYTES - len(self.body)
            if room > 0:
                self.body += bytes(message.get("body", b""))[:room]

    def error_object(self) -> dict[str, Any] | None:
        """The body's OpenAI `error` object, or the one set for an exception, or None."""
        if self.error is not None:
            return self.error
        try:
            error = json.loads(self.body).get("error")
        except (ValueError, AttributeError):
            return None
        return error if isinstance(error, dict) else None


def _trace_id(headers: Any) -> str | None:
    """The trace id of a W3C `traceparent` response header ("00-<32 hex>-<16 hex>-<2 hex>")."""
    for name, value in headers:
        if bytes(name).lower() == b"traceparent":
            parts = bytes(value).decode("latin-1").split("-")
            if len(parts) == 4 and len(parts[1]) == 32:
                return parts[1]
    return None
