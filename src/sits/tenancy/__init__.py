"""Tenants: configuration types, tenants.toml loading and API-key hashing (pure Python)."""

from sits.tenancy.config import (
    DEFAULT_TENANT_ID,
    TenantConfig,
    TenantsConfig,
    TenantValidationError,
    Tier,
)
from sits.tenancy.keys import hash_api_key, is_key_hash, normalize_key_hash
from sits.tenancy.loader import TenantConfigError, load_tenants, parse_tenants

__all__ = [
    "DEFAULT_TENANT_ID",
    "TenantConfig",
    "TenantConfigError",
    "TenantValidationError",
    "TenantsConfig",
    "Tier",
    "hash_api_key",
    "is_key_hash",
    "load_tenants",
    "normalize_key_hash",
    "parse_tenants",
]
