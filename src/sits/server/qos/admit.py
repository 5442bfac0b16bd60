"""Per-request quality of service in front of the engine: tenants, breaker, overload, rate limits.

`ServerQos.precheck` refuses before tokenization what `admit` would refuse whatever the
request's size (overload shedding, an empty rate bucket, full concurrency), so a flood of
refused requests costs no tokenizer time (one thread, shared with the requests that can run).
`ServerQos.admit` runs, for a request already authenticated and tokenized, in this order (the
first refusal answers, and a refused request consumes nothing; a half-open probe is handed
back):
1. per-request limits that no wait lifts (`AdmissionController.check_request_size`): 400 with
   the parameter named, in any overload state (a 503 would invite a hopeless retry);
2. circuit breaker `allow()`: open -> 503, code "circuit_open", Retry-After;
3. overload policy for the tenant's tier and quota in the current state: shed (red, and the
   tenant is best-effort or would borrow) -> 503, code "overloaded", Retry-After; yellow's
   "defer" admits: the engine's borrowing tiers make such work wait (`apply_borrowing`);
4. `AdmissionController.try_admit`: 429 (Retry-After, retry-after-ms, x-ratelimit-*).
`QosTicket.finish(outcome, used_tokens)` runs exactly once per admitted request (the serving
code calls it in a `finally`): it returns the admission ticket with the real usage (the token
bucket is reconciled), reports the outcome to the breaker (success for a served request,
failure for an engine error; client errors and disconnects say nothing about the engine, so a
probe is handed back) and counts the outcome per tenant.
A tenant "would borrow" when it holds at least its reserved KV blocks or sequence slots (the
engine's per-tenant stats); without configured tenants in the engine nobody borrows.

The tenant of a request (API-key authentication, before any of the above): every /v1 route,
/tokenize and /detokenize depend on `require_tenant`: the `Authorization: Bearer KEY` key maps
to a tenant through `ServerQos.authenticate` (`TenantsConfig.authenticate`: keys are stored as
SHA-256 digests and compared in constant time); a missing or unknown key gets 401 (OpenAI's
`invalid_api_key` body) unless the config has an anonymous tenant. Without `--tenants` the
config is `TenantsConfig.default(api_key)`: with `--api-key` that key is required, without it
every request is the default tenant's. /health and /metrics stay open for probes and scrapers.
With a router key (`--router-key`), a request presenting it is the fleet router's and its
tenant is the one the router names in `x-sits-tenant` (`sits.server.trusted.router_tenant`);
that header is ignored on requests with any other key. The tenant is stored in the request
state (`TENANT_STATE_KEY`) for handlers (`request_tenant`) and headers.
"""

from __future__ import annotations

import hmac
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from fastapi import Request

from sits.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionTicket,
    BreakerConfig,
    CircuitBreaker,
    Clock,
    OverloadMonitor,
    OverloadPolicy,
    OverloadSignals,
    OverloadState,
    OverloadThresholds,
    RejectReason,
    SystemClock,
    ratelimit_headers,
    retry_after_headers,
)
from sits.core.errors import EngineDeadError, SitsError
from sits.core.fleet import TENANT_HEADER
from sits.obs.tenant_metrics import TenantMetrics
from sits.server.engine_client import EngineClient
from sits.server.errors import ServerError
from sits.server.trusted import router_tenant
from sits.tenancy import TenantConfig, TenantsConfig, Tier

logger = logging.getLogger(__name__)

# ServerError codes of 503s that are not engine failures.
_NOT_ENGINE_FAILURES = frozenset({"draining", "overloaded", "circuit_open"})
_ALL_TIERS = frozenset(tier.value for tier in Tier)
_GUARANTEED_ONLY = frozenset({Tier.GUARANTEED.value})
# The request-state attribute holding the authenticated tenant (`require_tenant`).
TENANT_STATE_KEY = "sits_tenant"


class Outcome(StrEnum):
    """How a request ended (the `outcome` label of `sits:tenant_requests_total`)."""

    OK = "ok"
    BAD_REQUEST = "400"  # any client error but 404 and 429 (401 has no tenant: not counted)
    NOT_FOUND = "404"  # an unknown model
    RATE_LIMITED = "429"
    UNAVAILABLE = "503"  # draining, overload shedding, open breaker
    ERROR = "error"  # the engine failed (5xx, engine death)
    ABORT = "abort"  # the client went away


def is_engine_failure(exc: BaseException) -> bool:
    """True when `exc` says the engine failed (what the circuit breaker counts)."""
    if isinstance(exc, EngineDeadError):
        return True
    if isinstance(exc, ServerError):
        return exc.status >= 500 and exc.code not in _NOT_ENGINE_FAILURES
    return not isinstance(exc, SitsError)


def outcome_of(exc: BaseException) -> Outcome:
    """The outcome of a request that ended with `exc`."""
    if is_engine_failure(exc):
        return Outcome.ERROR
    status = exc.status if isinstance(exc, ServerError) else 400
    if status == 404:
        return Outcome.NOT_FOUND
    if status == 429:
        return Outcome.RATE_LIMITED
    if status == 503:
        return Outcome.UNAVAILABLE
    return Outcome.BAD_REQUEST


@dataclass(frozen=True, slots=True)
class QosSettings:
    """Admission, breaker and overload options of a server.

    Attributes:
        rate_limit_period_s: refill window of the per-minute limits (60; shorter for tests).
        concurrency_retry_after_s: Retry-After of a max_concurrent rejection, >= 1.
        breaker: circuit breaker limits.
        overload: overload thresholds (queue delay, KV usage, predicted TTFT / SLO).
        shed_retry_after_s: Retry-After of a request shed in red, >= 1.
        overload_poll_s: how often the overload watcher samples the engine.
        prefill_rate_alpha: EMA weight of a new prefill-rate sample, in (0, 1].
        clock: time source of rate limits, breaker and overload hold times (None: monotonic).
    """

    rate_limit_period_s: float = 60.0
    concurrency_retry_after_s: int = 1
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    overload: OverloadThresholds = field(default_factory=OverloadThresholds)
    shed_retry_after_s: int = 5
    overload_poll_s: float = 0.25
    prefill_rate_alpha: float = 0.2
    clock: Clock | None = None


# Share of an over-quota request's TTFT limit left for its prefill and first-token delivery
# once started: the engine must start it within the rest (`QosTicket.start_within_s`). The
# scheduler serves the earliest deadline first, so without it the requests it started were the
# oldest ones, whose first tokens came just after their limit (H200, 2026-11-30: 20 % of the
# burstable tenant's requests met a 5 s TTFT while 35 % were served).
FIRST_TOKEN_ALLOWANCE = 0.1
# The share of the TTFT limit within which the engine must start such a request; also the wait
# of the tenant's oldest queued request past which its new over-quota work is refused at
# admission (`ServerQos.backlog_shed_reason`): as long as the engine may still start that
# request, new work behind it may also make it in time. Refusing from half the limit shed work
# that FCFS then served within its SLO (CPU bench: QoS/FCFS 0.807 instead of 1.022).
START_WITHIN_SHARE = 1.0 - FIRST_TOKEN_ALLOWANCE


class QosTicket:
    """An admitted request's QoS state; `finish` (idempotent) ends it.

    Attributes:
        tenant: the request's tenant.
        admission: the admission ticket (returned by `finish`).
        is_probe: the request is the breaker's half-open probe.
        queue_timeout_s: for over-quota work of a burstable or best-effort tenant, its TTFT
            limit (TTFT SLO x `backlog_shed_factor`) in seconds; a request the engine has not
            started by `start_within_s` is shed (503): it could only miss that limit and
            would hold up the tenant's queue. None for everything else (guaranteed tenants,
            work within a reservation).
    """

    def __init__(
        self,
        qos: ServerQos,
        tenant: TenantConfig,
        admission: AdmissionTicket,
        is_probe: bool,
        queue_timeout_s: float | None = None,
    ) -> None:
        self._qos = qos
        self.tenant = tenant
        self.admission = admission
        self.is_probe = is_probe
        self.queue_timeout_s = queue_timeout_s
        self.finished = False

    @property
    def start_within_s(self) -> float | None:
        """Seconds from admission by which the engine must start the request (its start
        deadline, `Request.start_deadline_s`): the TTFT limit less `FIRST_TOKEN_ALLOWANCE` of
        it for the prefill and the delivery of the first token, so that a request started in
        time meets the limit. None without a queue timeout."""
        if self.queue_timeout_s is None:
            return None
        return START_WITHIN_SHARE * self.queue_timeout_s

    @property
    def retry_after_s(self) -> int:
        """Retry-After (seconds) of a request shed after admission."""
        return self._qos.settings.shed_retry_after_s

    def finish(self, outcome: Outcome, used_tokens: int, num_prompts: int = 1) -> None:
        """End the request: reconcile tokens, report to the breaker, count the outcome.

        Args:
            outcome: how it ended.
            used_tokens: prompt + completion tokens it really consumed (>= 0).
            num_prompts: its prompts (engine requests), the unit of the SLO counters.
        """
        if self.finished:
            return
        self.finished = True
        qos = self._qos
        qos.admission.release(self.admission, max(used_tokens, 0))
        if outcome is Outcome.OK:
            qos.breaker.record_success()
        elif outcome is Outcome.ERROR:
            qos.breaker.record_failure()
        elif self.is_probe:
            qos.breaker.release_probe()
        qos.metrics.count_outcome(self.tenant.id, outcome.value, num_prompts)


class ServerQos:
    """The server's tenants, admission controller, circuit breaker and overload state.

    Args:
        engine: the engine front end (its stats give per-tenant usage; its
            `set_borrowing_tiers`, when it has one, receives the overload decisions).
        tenants: every tenant (`TenantsConfig.default(api_key)` without `--tenants`).
        settings: limits, clock and periods.
        metrics: per-tenant metrics (outcomes are counted here).
        isolate_prefix_cache: salt the prefix cache with the tenant id (with `--tenants`).
    """

    def __init__(
        self,
        engine: EngineClient,
        tenants: TenantsConfig,
        settings: QosSettings,
        metrics: TenantMetrics,
        *,
        isolate_prefix_cache: bool,
    ) -> None:
        self.engine = engine
        self.tenants = tenants
        self.settings = settings
        self.metrics = metrics
        self.isolate_prefix_cache = isolate_prefix_cache
        clock = settings.clock
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.admission = AdmissionController(
            tenants,
            clock,
            period_s=settings.rate_limit_period_s,
            concurrency_retry_after_s=settings.concurrency_retry_after_s,
        )
        self.breaker = CircuitBreaker(settings.breaker, clock)
        self.monitor = OverloadMonitor(settings.overload, clock)
        self.policy = OverloadPolicy(settings.shed_retry_after_s)
        self._override: OverloadState | None = None
        self._applied_tiers = _ALL_TIERS

    # --- tenants ---------------------------------------------------------------------------
    def authenticate(self, api_key: str | None) -> TenantConfig | None:
        """The tenant of `api_key` (or the anonymous tenant); None means 401."""
        return self.tenants.authenticate(api_key)

    def cache_salt(self, tenant: TenantConfig, request_salt: str | None) -> str | None:
        """The prefix-cache namespace of a request.

        With isolation: the tenant id, joined with the request's own `cache_salt` by a unit
        separator (tenant ids never contain one), so a tenant never hits another's prefixes.
        Without: the request's `cache_salt` unchanged.
        """
        if not self.isolate_prefix_cache:
            return request_salt
        return tenant.id if request_salt is None else f"{tenant.id}\x1f{request_salt}"

    def ratelimit_headers(self, tenant: TenantConfig) -> dict[str, str]:
        """The tenant's x-ratelimit-* headers now ({} for a tenant without rate limits)."""
        if tenant.requests_per_minute is None and tenant.tokens_per_minute is None:
            return {}
        return ratelimit_headers(self.admission.snapshot(tenant))

    # --- overload --------------------------------------------------------------------------
    @property
    def overload_state(self) -> OverloadState:
        """The forced state when one is set (`force_overload_state`), else the monitor's."""
        return self._override or self.monitor.state

    def observe(self, signals: OverloadSignals, idle: bool = False) -> OverloadState:
        """Feed the monitor one measurement and apply the resulting state; returns it.
        `idle` (nothing running or waiting in the engine): green at once (`calm_down`)."""
        if idle:
            self.monitor.calm_down()
        else:
            self.monitor.update(signals)
        state = self.overload_state
        self.apply_borrowing(state)
        return state

    def force_overload_state(self, state: OverloadState | None) -> None:
        """Pin the overload state (operators, tests); None returns to the measured state.

        The engine's borrowing tiers follow at once.
        """
        self._override = state
        self.apply_borrowing(self.overload_state)

    def apply_borrowing(self, state: OverloadState) -> None:
        """Green: every tier may borrow; yellow and red: only guaranteed tenants (best-effort
        work waits and burstable borrowing stops). Sent to the engine only on a change."""
        tiers = _ALL_TIERS if state is OverloadState.GREEN else _GUARANTEED_ONLY
        if tiers == self._applied_tiers:
            return
        setter = getattr(self.engine, "set_borrowing_tiers", None)
        if setter is None:
            return
        try:
            setter(tiers)
        except Exception:  # noqa: BLE001 - a dead engine refuses nothing more
            logger.warning("could not set the engine's borrowing tiers", exc_info=True)
            return
        self._applied_tiers = tiers
        logger.info("overload %s: tiers allowed to borrow: %s", state.value, sorted(tiers))

    def counts_toward_load(self, tenant_id: str) -> bool:
        """Does the tenant's queued work count in the overload signals?

        A guaranteed tenant's does, and a tenant's that is not configured: the state measures
        the risk to protected work. A burstable or best-effort tenant's backlog is its own
        (the reclaim of reservations keeps it from delaying guaranteed work); it is bounded by
        `backlog_shed_reason` instead. Counting it would hold the server in yellow or red,
        where borrowing stops, while the GPU idles (seen on the H200 on 2026-11-30: red for
        minutes at 4 % KV use, because a burstable tenant's oldest request kept aging).
        """
        tenant = self.tenants.get(tenant_id)
        return tenant is None or tenant.tier is Tier.GUARANTEED

    def backlog_shed_reason(self, tenant: TenantConfig) -> str | None:
        """Why new over-quota work of a burstable or best-effort tenant is shed now, or None.

        Shed when the tenant's own oldest queued request has already waited longer than
        `START_WITHIN_SHARE` x its TTFT limit (`backlog_limit_s`), the engine's start
        deadline (`QosTicket.start_within_s`): a new request would wait about as long (its
        queue is served oldest deadline first), so it would only be dropped after queueing.
        """
        limit_s = self.backlog_limit_s(tenant)
        if limit_s is None:
            return None
        try:
            waiting = getattr(self.engine.stats(), "waiting", None) or {}
        except Exception:  # noqa: BLE001 - no stats: nothing to judge by
            return None
        own = waiting.get(tenant.id)
        if own is None or own.oldest_arrival_s is None:
            return None
        waited_s = self.clock.monotonic() - own.oldest_arrival_s
        admit_s = START_WITHIN_SHARE * limit_s
        if waited_s <= admit_s:
            return None
        return (
            f"its queued work has waited {waited_s:.1f} s, over {admit_s:g} s "
            f"({START_WITHIN_SHARE:g} x its {limit_s:g} s first-token limit)"
        )

    def would_borrow(self, tenant: TenantConfig) -> bool:
        """True when new work of the tenant would go beyond its reservation (see module)."""
        try:
            stats = getattr(self.engine.stats(), "tenants", None) or {}
        except Exception:  # noqa: BLE001 - no stats: treat as within the reservation
            return False
        own = stats.get(tenant.id)
        if own is None:
            return False
        return own.blocks_used >= own.blocks_reserved or own.num_running >= own.seqs_reserved

    # --- admission -------------------------------------------------------------------------
    def admit(
        self,
        tenant: TenantConfig,
        prompt_tokens: int,
        max_tokens: int,
        param_names: Mapping[str, str] | None = None,
    ) -> QosTicket:
        """Admit one request (checks in the module docstring's order).

        Args:
            tenant: the authenticated tenant.
            prompt_tokens: the request's prompt tokens (all its prompts).
            max_tokens: the most tokens it may generate (all prompts and samples).
            param_names: the request's own names for the parameters a 400 blames ("prompt",
                "max_tokens"), e.g. a chat's {"prompt": "messages"}; None: those names.

        Raises:
            ServerError: 503 (breaker open, overload shedding), 429 (rate or concurrency
                limit) or 400 (a per-request limit), with Retry-After / x-ratelimit headers.
        """
        too_large = self.admission.check_request_size(tenant, prompt_tokens, max_tokens)
        if too_large is not None:
            raise rejection_error(too_large, param_names)
        breaker = self.breaker.allow()
        if not breaker.allowed:
            retry_s = breaker.retry_after_s or 1
            raise ServerError(
                503,
                "The engine is failing; requests are refused while it recovers (circuit "
                f"breaker open). Retry after {retry_s} s.",
                type="service_unavailable_error",
                code="circuit_open",
                headers=retry_after_headers(retry_s),
            )
        try:
            over_quota = self._check_overload(tenant)
            decision = self.admission.try_admit(tenant, prompt_tokens, max_tokens)
        except BaseException:
            if breaker.is_probe:
                self.breaker.release_probe()
            raise
        if decision.ticket is None:
            if breaker.is_probe:
                self.breaker.release_probe()
            raise rejection_error(decision)
        timeout_s = self.backlog_limit_s(tenant) if over_quota else None
        return QosTicket(self, tenant, decision.ticket, breaker.is_probe, timeout_s)

    def precheck(self, tenant: TenantConfig) -> None:
        """Refuse, before the prompt is tokenized, a request that `admit` would refuse
        whatever its size: shed by the overload state (503), or over a rate or concurrency
        limit (429, counted as `admit` counts it). The per-request size limits (400) need
        the prompt's tokens: a request both too large and over its rate limit gets the 429.

        Raises:
            ServerError: as `admit`'s 503 (overloaded) and 429.
        """
        self._check_overload(tenant)
        decision = self.admission.precheck(tenant)
        if decision is not None:
            raise rejection_error(decision)

    def backlog_limit_s(self, tenant: TenantConfig) -> float | None:
        """How long a burstable or best-effort tenant's over-quota work may wait for its
        first token: `backlog_shed_factor` x its TTFT SLO (without one: the red queue-delay
        threshold); None for a guaranteed tenant or an infinite factor."""
        thresholds = self.settings.overload
        if tenant.tier is Tier.GUARANTEED or math.isinf(thresholds.backlog_shed_factor):
            return None
        slo_s = thresholds.red_queue_delay_s if tenant.ttft_ms is None else tenant.ttft_ms / 1000
        return thresholds.backlog_shed_factor * slo_s

    def _check_overload(self, tenant: TenantConfig) -> bool:
        """Shed (raise 503) or admit; returns whether the work is over quota."""
        state = self.overload_state
        if tenant.tier is Tier.GUARANTEED and state is OverloadState.GREEN:
            return False
        over_quota = tenant.tier is Tier.BEST_EFFORT or self.would_borrow(tenant)
        if not over_quota:
            return False
        decision = self.policy.admit(state, tenant.tier, over_quota)
        why = f"the server is overloaded ({state.value})"
        if decision.admitted:
            backlog = self.backlog_shed_reason(tenant)
            if backlog is None:
                return True
            why = backlog
        retry_s = decision.retry_after_s or self.settings.shed_retry_after_s
        raise ServerError(
            503,
            f"New work of tenant '{tenant.id}' ({tenant.tier.value}, beyond its reservation) "
            f"is shed: {why}. Retry after {retry_s} s.",
            type="service_unavailable_error",
            code="overloaded",
            headers=retry_after_headers(retry_s),
        )


# --- the tenant of a request (module docstring) -------------------------------------------
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


def rejection_error(
    decision: AdmissionDecision, param_names: Mapping[str, str] | None = None
) -> ServerError:
    """The ServerError of an admission refusal (429 retryable, 400 per-request limit, its
    parameter renamed by `param_names`); also the fleet router's answer to a tenant over its
    fleet-wide limits, so both answer with the same status, codes and headers."""
    reason, message = decision.reason, decision.message
    assert reason is not None
    headers = ratelimit_headers(decision)
    if reason.retryable:
        kind = "tokens" if reason is RejectReason.TOKENS else "requests"
        code = (
            "concurrency_limit_exceeded"
            if reason is RejectReason.CONCURRENCY
            else "rate_limit_exceeded"
        )
        return ServerError(429, message, type=kind, code=code, headers=headers)
    param = decision.param
    if param_names is not None and param is not None:
        param = param_names.get(param, param)
    return ServerError(400, message, param=param, code=reason.value, headers=headers)
