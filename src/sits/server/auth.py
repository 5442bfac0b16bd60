"""API-key authentication for the OpenAI routes: `Authorization: Bearer KEY` -> a tenant.

Every /v1 route, /tokenize and /detokenize go through `require_tenant`: the key maps to a
tenant through `TenantsConfig.authenticate` (keys are stored as SHA-256 digests and compared
in constant time); a missing or unknown key gets 401 (OpenAI's `invalid_api_key` body) unless
the config has an anonymous tenant. Without `--tenants` the config is
`TenantsConfig.default(api_key)`: with `--api-key` that key is required, without it every
request is the default tenant's. /health and /metrics stay open for probes and scrapers.
With a router key (`--router-key`), a request presenting it is the fleet router's and its
tenant is the one the router names in `x-sits-tenant` (`sits.server.trusted.router_tenant`);
that header is ignored on requests with any other key.
The tenant is stored in the request state (`TENANT_STATE_KEY`) for handlers and headers.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from sits.core.fleet import TENANT_HEADER
from sits.server.errors import ServerError
from sits.server.qos.headers import TENANT_STATE_KEY
from sits.server.trusted import router_tenant
from sits.tenancy import TenantConfig


def presented_key(request: Request) -> str | None:
    """The bearer key of the request, or None (no header or another scheme)."""
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


async def require_tenant(request: Request) -> None:
    """FastAPI dependency: authenticate the request's tenant or raise 401.

    Raises:
        ServerError: 401 with code "invalid_api_key"; for the router key, 401 with code
            "unknown_tenant" or "missing_tenant_header" (`router_tenant`).
    """
    ctx = request.app.state.ctx
    presented = presented_key(request)
    router_key = ctx.settings.router_key
    if router_key and keys_match(router_key, presented):
        header = request.headers.get(TENANT_HEADER)
        from_file = ctx.settings.tenants is not None
        tenant = router_tenant(ctx.qos.tenants, header, from_file=from_file)
        setattr(request.state, TENANT_STATE_KEY, tenant)
        return
    tenant = ctx.qos.authenticate(presented)
    if tenant is None:
        message = (
            "Missing API key: pass it as 'Authorization: Bearer KEY'."
            if not presented
            else "Incorrect API key provided."
        )
        raise ServerError(401, message, code="invalid_api_key")
    setattr(request.state, TENANT_STATE_KEY, tenant)


async def require_model_reader(request: Request) -> None:
    """FastAPI dependency of the model list: the router's key alone may read it (the fleet router
    learns a static replica's models so, and the list holds no tenant's data); any other request
    authenticates as `require_tenant` says.

    Raises:
        ServerError: 401 as `require_tenant`.
    """
    router_key = request.app.state.ctx.settings.router_key
    if (
        router_key
        and not request.headers.get(TENANT_HEADER)
        and keys_match(router_key, presented_key(request))
    ):
        return
    await require_tenant(request)


def request_tenant(request: Request) -> TenantConfig:
    """The tenant `require_tenant` stored for this request."""
    tenant = getattr(request.state, TENANT_STATE_KEY, None)
    assert tenant is not None, "route without the require_tenant dependency"
    return tenant
