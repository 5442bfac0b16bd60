"""`RouterSettings`: what `sits router` decides at start (flags, files); immutable.

Defaults are the documented ones of `sits router --help` (README, "Fleet"): a request is tried
on at most `max_attempts` replicas, each attempt waits at most `first_byte_timeout_s` for the
replica's first response byte and the whole request at most `request_timeout_s`; replicas are
probed every `probe_interval_s`; the predicted-P99 fallback threshold is `fallback_p99_s` unless
the tenant has a `ttft_ms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sits.admission import BreakerConfig
from sits.core.errors import InvalidParameterError
from sits.core.fleet import normalize_url
from sits.router.canary import CanaryConfig
from sits.tenancy import TenantsConfig

DEFAULT_FALLBACK_P99_S = 0.8  # the seeds: route away when the predicted P99 exceeds 800 ms
DEFAULT_LOAD_BOUND = 4.0
DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Options of one router.

    Attributes:
        router_key: the bearer key of registration, heartbeats and the router's admin routes;
            also the key the router presents to replicas when it forwards a tenant's request
            (with the tenant in `x-sits-tenant`). None: registration is refused (static
            replicas only) and clients' own keys pass through to the replicas.
        replicas: static primary replica URLs (`--replica`).
        fallbacks: static fallback pool URLs (`--fallback`): used when no primary replica is
            predicted under the TTFT limit, and when no primary replica is left.
        canaries: static canary replica URLs (`--canary`); replicas registering with the
            version label "canary" join them.
        tenants: the tenants (`--tenants`): keys, request and token rate limits applied once
            for the whole fleet; None: no router-side authentication or limits.
        fallback_p99_s: predicted TTFT P99 above which a request goes to the fallback pool,
            seconds, for tenants without `ttft_ms`.
        load_bound: how far (in `load_score` units) the prefix-affine replica's load may exceed
            the least loaded one's before the request goes to the least loaded.
        max_attempts: replicas tried per request (the retry budget is max_attempts - 1).
        first_byte_timeout_s: seconds an attempt waits for the replica's first response byte
            (a non-streamed request's whole answer) before it is retried elsewhere.
        request_timeout_s: seconds a request may take in all, retries included.
        probe_interval_s: seconds between active `/health` probes of each replica.
        probe_timeout_s: seconds a probe may take before it counts as failed.
        heartbeat_interval_s: the replicas' heartbeat period, seconds.
        missed_heartbeats: heartbeats missed in a row before a replica is taken out.
        breaker: the per-replica circuit breaker's limits.
        canary: the canary's weights and bounds.
        max_connections: httpx connection pool size (all replicas together).
        seed: seed of the canary's random split (tests make it exact).

    Raises:
        InvalidParameterError: a value out of range, or tenants without a router key (the
            replicas could not trust the forwarded tenant).
    """

    router_key: str | None = None
    replicas: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    canaries: tuple[str, ...] = ()
    tenants: TenantsConfig | None = None
    fallback_p99_s: float = DEFAULT_FALLBACK_P99_S
    load_bound: float = DEFAULT_LOAD_BOUND
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    first_byte_timeout_s: float = 300.0
    request_timeout_s: float = 600.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    heartbeat_interval_s: float = 2.0
    missed_heartbeats: int = 3
    breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig(open_s=10.0))
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    max_connections: int = 1000
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("replicas", "fallbacks", "canaries"):
            urls = tuple(normalize_url(u) for u in getattr(self, name))
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    raise InvalidParameterError(name, f"not an http(s) URL: {url!r}")
            object.__setattr__(self, name, urls)
        if self.tenants is not None and not self.router_key:
            raise InvalidParameterError(
                "router_key",
                "--tenants needs --router-key: replicas trust the tenant the router forwards "
                "only from the router's key",
            )
        for name in (
            "fallback_p99_s",
            "first_byte_timeout_s",
            "request_timeout_s",
            "probe_interval_s",
            "probe_timeout_s",
            "heartbeat_interval_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidParameterError(name, f"must be a number > 0, got {value!r}")
        if not (math.isfinite(self.load_bound) and self.load_bound >= 0):
            raise InvalidParameterError("load_bound", f"must be >= 0, got {self.load_bound!r}")
        for name in ("max_attempts", "missed_heartbeats", "max_connections"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"must be >= 1, got {getattr(self, name)}")
