"""The router's trusted tenant header: which tenant a request forwarded by `sits router` is.

A request whose bearer key is the server's router key (`--router-key`, compared in constant
time) is the router's: the router has authenticated the client already and names its tenant in
`TENANT_HEADER` (`x-sits-tenant`). `router_tenant` maps that header to the tenant:
- a tenant id of the server's tenants config -> that tenant (without `--tenants` only the
  default tenant's id, "default", is one);
- another id -> 401, code "unknown_tenant";
- no header (or an empty one) -> the default tenant when the server has no tenants file, else
  401, code "missing_tenant_header" (a tenants file means every request names its tenant).
The header from any other key is never read (`sits.server.qos.admit.require_tenant`): only the
router can choose a tenant that way.
"""

from __future__ import annotations

from sits.core.fleet import TENANT_HEADER
from sits.server.errors import ServerError
from sits.tenancy import TenantConfig, TenantsConfig


def router_tenant(
    tenants: TenantsConfig, tenant_id: str | None, *, from_file: bool
) -> TenantConfig:
    """The tenant of a request that presented the router key (see the module docstring).

    Args:
        tenants: the server's tenants (the file's, or the default config).
        tenant_id: the TENANT_HEADER value, or None when absent.
        from_file: the tenants come from `--tenants`.

    Raises:
        ServerError: 401 "unknown_tenant" or "missing_tenant_header".
    """
    if tenant_id:
        tenant = tenants.get(tenant_id)
        if tenant is None:
            raise ServerError(
                401,
                f"Unknown tenant {tenant_id!r} in the {TENANT_HEADER} header.",
                code="unknown_tenant",
            )
        return tenant
    if from_file:
        raise ServerError(
            401,
            f"A request with the router key must name its tenant in the {TENANT_HEADER} header.",
            code="missing_tenant_header",
        )
    (tenant,) = tenants.tenants  # the default config's one tenant
    return tenant
