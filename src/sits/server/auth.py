"""API-key check for the OpenAI routes (`Authorization: Bearer KEY`).

When the server has a key, every /v1 route, /tokenize and /detokenize answer 401 (OpenAI's
`invalid_api_key` body) to a request without it or with another one; /health and /metrics stay
open for probes and scrapers. Keys are compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac

from fastapi import Request

from sits.server.errors import ServerError


def _presented_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip()


def keys_match(expected: str, presented: str | None) -> bool:
    """True when `presented` equals `expected` (constant time over the bytes)."""
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


async def require_api_key(request: Request) -> None:
    """FastAPI dependency: raise 401 unless the request carries the server's key.

    Raises:
        ServerError: 401 with code "invalid_api_key".
    """
    expected = request.app.state.ctx.settings.api_key
    if expected is None:
        return
    presented = _presented_key(request)
    if not keys_match(expected, presented):
        message = (
            "Missing API key: pass it as 'Authorization: Bearer KEY'."
            if presented is None
            else "Incorrect API key provided."
        )
        raise ServerError(401, message, code="invalid_api_key")
