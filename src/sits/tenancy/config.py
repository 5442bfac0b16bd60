"""Tenant configuration types: who a tenant is, what it is promised and what it may use.

Invariants (checked at construction, so a config that exists is valid):
- a tenant id is 1-64 characters of [A-Za-z0-9_.-], starting with a letter or digit;
- every key hash is 64 lowercase hex characters (SHA-256 of the key; keys never in clear);
- `guaranteed` tenants reserve a share > 0, `best_effort` tenants reserve nothing, and the
  reserved shares of all tenants sum to at most 1;
- limits are None (unlimited) or integers >= 1; SLOs are None or > 0;
- ids and key hashes are unique across tenants.
Pure Python (layer L1 rules): no engine, torch or server imports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from sits.core.errors import InvalidParameterError
from sits.tenancy.keys import hash_api_key, is_key_hash, key_hashes_equal

DEFAULT_TENANT_ID = "default"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "max_tokens_per_request",
    "max_prompt_tokens",
)
# Float tolerance when summing reserved fractions (0.1 + 0.2 + 0.7 must pass).
_FRACTION_EPS = 1e-9


class Tier(Enum):
    """Service tier: what capacity a tenant may count on.

    GUARANTEED: a reserved share of KV blocks and sequence slots, always there for it.
    BURSTABLE: a smaller reservation plus borrowing of idle capacity (borrowed part is
        preempted first).
    BEST_EFFORT: idle capacity only.
    """

    GUARANTEED = "guaranteed"
    BURSTABLE = "burstable"
    BEST_EFFORT = "best_effort"


class TenantValidationError(InvalidParameterError):
    """A tenant (or the tenant set) breaks an invariant.

    Attributes:
        param: the offending field, as spelled in tenants.toml (e.g. "tier").
        tenant_index: position of the offending tenant in the file; None for a file-level field.
    """

    def __init__(self, param: str, message: str, tenant_index: int | None = None) -> None:
        super().__init__(param, message)
        self.tenant_index = tenant_index


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant's identity, tier, fair-share weight, SLOs and limits.

    Attributes:
        id: tenant name (metrics label, prefix-cache salt source, log field).
        api_key_sha256: SHA-256 hex digests of the tenant's API keys (list -> tuple, lowercased).
        tier: guaranteed | burstable | best_effort (a `Tier` or its string value).
        reserved_kv_fraction: share in [0, 1] of KV blocks and sequence slots kept for it.
        weight: > 0, fair-share weight within its tier.
        priority: lower runs first (any integer).
        ttft_ms, tpot_ms: SLOs in milliseconds (deadlines, overload decisions); None = none.
        requests_per_minute: request rate limit; None = unlimited.
        tokens_per_minute: prompt + completion token rate limit; None = unlimited.
        max_concurrent: most requests in flight at once; None = unlimited.
        max_tokens_per_request: largest `max_tokens` accepted; None = unlimited.
        max_prompt_tokens: largest prompt accepted, in tokens; None = unlimited.

    Raises:
        TenantValidationError: a field is out of range (`param` names it).
    """

    id: str
    api_key_sha256: tuple[str, ...] = ()
    tier: Tier = Tier.BEST_EFFORT
    reserved_kv_fraction: float = 0.0
    weight: float = 1.0
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    max_tokens_per_request: int | None = None
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or _ID_RE.fullmatch(self.id) is None:
            raise TenantValidationError(
                "id", f"tenant id {self.id!r} must be 1-64 characters of [A-Za-z0-9_.-]"
            )
        self._normalize_keys()
        self._normalize_tier()
        self._check_reservation()
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise TenantValidationError(
                "weight", f"weight must be a finite number > 0, got {self.weight}"
            )
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise TenantValidationError(
                    name, f"{name} must be a finite number > 0, got {value}"
                )
        for name in _LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise TenantValidationError(
                    name, f"{name} must be >= 1 (omit it for no limit), got {value}"
                )

    def _normalize_keys(self) -> None:
        raw = self.api_key_sha256
        hashes = (raw,) if isinstance(raw, str) else tuple(raw)
        for value in hashes:
            if not isinstance(value, str) or not is_key_hash(value):
                raise TenantValidationError(
                    "api_key_sha256",
                    f"{value!r} is not a SHA-256 hex digest (64 hex characters); "
                    "make one with `sits tenants hash-key -`",
                )
        lowered = tuple(value.lower() for value in hashes)
        if len(set(lowered)) != len(lowered):
            raise TenantValidationError("api_key_sha256", "the same key hash is listed twice")
        object.__setattr__(self, "api_key_sha256", lowered)

    def _normalize_tier(self) -> None:
        if isinstance(self.tier, Tier):
            return
        try:
            object.__setattr__(self, "tier", Tier(self.tier))
        except ValueError:
            allowed = " | ".join(t.value for t in Tier)
            raise TenantValidationError(
                "tier", f"tier must be one of {allowed}, got {self.tier!r}"
            ) from None

    def _check_reservation(self) -> None:
        fraction = self.reserved_kv_fraction
        if not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0):
            raise TenantValidationError(
                "reserved_kv_fraction", f"reserved_kv_fraction must be in [0, 1], got {fraction}"
            )
        if self.tier is Tier.BEST_EFFORT and fraction > 0:
            raise TenantValidationError(
                "reserved_kv_fraction",
                "a best_effort tenant uses idle capacity only; its reserved_kv_fraction must be 0",
            )
        if self.tier is Tier.GUARANTEED and fraction == 0:
            raise TenantValidationError(
                "reserved_kv_fraction", "a guaranteed tenant needs a reserved_kv_fraction > 0"
            )


def tenant_set_errors(
    tenants: Sequence[TenantConfig], anonymous_tenant_id: str | None
) -> list[TenantValidationError]:
    """Every rule a set of valid tenants breaks together, in file order (`TenantsConfig`
    raises the first): no tenants, a duplicate id or key hash, reserved fractions summing over
    1 (once, at the tenant where the sum first passes 1), an undefined anonymous tenant, a
    tenant without keys that is not the anonymous one (nobody can reach it).

    Each error's `tenant_index` is the tenant's position in `tenants` (None for a file-level
    field).
    """
    if not tenants:
        return [TenantValidationError("tenants", "at least one tenant is needed")]
    errors = []
    by_id: dict[str, TenantConfig] = {}
    by_key_hash: dict[str, TenantConfig] = {}
    reserved = 0.0
    for index, tenant in enumerate(tenants):
        if tenant.id in by_id:
            errors.append(TenantValidationError("id", f"duplicate tenant id {tenant.id!r}", index))
        by_id.setdefault(tenant.id, tenant)
        for key_hash in tenant.api_key_sha256:
            owner = by_key_hash.setdefault(key_hash, tenant)
            if owner is not tenant:
                errors.append(
                    TenantValidationError(
                        "api_key_sha256",
                        f"key hash {key_hash[:12]}... already belongs to tenant {owner.id!r}",
                        index,
                    )
                )
        over_before = reserved > 1.0 + _FRACTION_EPS
        reserved += tenant.reserved_kv_fraction
        if reserved > 1.0 + _FRACTION_EPS and not over_before:
            errors.append(
                TenantValidationError(
                    "reserved_kv_fraction",
                    f"reserved_kv_fraction of tenants up to {tenant.id!r} sums to {reserved:g} > 1",
                    index,
                )
            )
    if anonymous_tenant_id is not None and anonymous_tenant_id not in by_id:
        errors.append(
            TenantValidationError(
                "anonymous_tenant", f"anonymous tenant {anonymous_tenant_id!r} is not defined"
            )
        )
    for index, tenant in enumerate(tenants):
        if not tenant.api_key_sha256 and tenant.id != anonymous_tenant_id:
            errors.append(
                TenantValidationError(
                    "api_key_sha256",
                    f"tenant {tenant.id!r} has no api_key_sha256 and is not the anonymous "
                    "tenant, so no request can reach it",
                    index,
                )
            )
    return errors


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """Every tenant of a server, with key lookup.

    Attributes:
        tenants: the tenants, in file order.
        anonymous_tenant_id: tenant given to requests with no key or an unknown key; None means
            such requests are refused (HTTP 401). Only this tenant may have no key.

    Raises:
        TenantValidationError: no tenants, duplicate ids or key hashes, reserved fractions
            summing over 1, an unknown anonymous tenant, or a tenant nobody can reach.
    """

    tenants: tuple[TenantConfig, ...]
    anonymous_tenant_id: str | None = None
    _by_id: Mapping[str, TenantConfig] = field(init=False, repr=False, compare=False)
    _by_key_hash: Mapping[str, TenantConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tenants = tuple(self.tenants)
        object.__setattr__(self, "tenants", tenants)
        errors = tenant_set_errors(tenants, self.anonymous_tenant_id)
        if errors:
            raise errors[0]
        by_key_hash = {key_hash: t for t in tenants for key_hash in t.api_key_sha256}
        object.__setattr__(self, "_by_id", {tenant.id: tenant for tenant in tenants})
        object.__setattr__(self, "_by_key_hash", by_key_hash)

    @classmethod
    def default(cls, api_key: str | None = None) -> TenantsConfig:
        """The config used without `--tenants`: one guaranteed tenant "default" owning all.

        Args:
            api_key: the server's `--api-key`; None means no auth (every request, with any key
                or none, is the default tenant's). The key is hashed at once, never stored.
        """
        hashes = () if api_key is None else (hash_api_key(api_key),)
        tenant = TenantConfig(
            id=DEFAULT_TENANT_ID,
            api_key_sha256=hashes,
            tier=Tier.GUARANTEED,
            reserved_kv_fraction=1.0,
        )
        return cls((tenant,), anonymous_tenant_id=None if api_key else DEFAULT_TENANT_ID)

    @property
    def requires_auth(self) -> bool:
        """True when a request without a known key is refused (no anonymous tenant)."""
        return self.anonymous_tenant_id is None

    @property
    def ids(self) -> tuple[str, ...]:
        """Tenant ids in file order."""
        return tuple(tenant.id for tenant in self.tenants)

    @property
    def min_ttft_ms(self) -> float | None:
        """The tightest TTFT SLO of the guaranteed tenants, whose queued work the overload
        monitor measures (`ServerQos.counts_toward_load`); None if none has one."""
        guaranteed = [t for t in self.tenants if t.tier is Tier.GUARANTEED]
        slos = [t.ttft_ms for t in guaranteed if t.ttft_ms is not None]
        return min(slos) if slos else None

    def get(self, tenant_id: str) -> TenantConfig | None:
        """The tenant with this id, or None."""
        return self._by_id.get(tenant_id)

    def authenticate(self, api_key: str | None) -> TenantConfig | None:
        """The tenant owning `api_key`, else the anonymous tenant, else None (-> HTTP 401).

        The key is hashed (SHA-256) and looked up by its digest in O(1); the stored digest is
        then compared in constant time (`hmac.compare_digest`). A lookup keyed by a SHA-256
        digest leaks nothing usable about stored keys through timing. An empty key counts as
        no key.
        """
        if api_key:
            digest = hash_api_key(api_key)
            tenant = self._by_key_hash.get(digest)
            if tenant is not None and any(
                key_hashes_equal(digest, stored) for stored in tenant.api_key_sha256
            ):
                return tenant
        if self.anonymous_tenant_id is None:
            return None
        return self._by_id[self.anonymous_tenant_id]

    def __iter__(self) -> Iterator[TenantConfig]:
        return iter(self.tenants)

    def __len__(self) -> int:
        return len(self.tenants)
