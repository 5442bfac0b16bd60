"""`AdmissionController`: per-tenant rate limits and concurrency caps in front of the engine.

Order of checks for `try_admit` (the first failing group decides):
1. per-request size (HTTP 400, not retryable): prompt_tokens > max_prompt_tokens, max_tokens >
   max_tokens_per_request, prompt_tokens + max_tokens > tokens_per_minute;
2. limits that a wait lifts (HTTP 429): concurrency (max_concurrent), requests_per_minute
   (1 per request), tokens_per_minute (prompt_tokens + max_tokens reserved per request). When
   several block, the one with the longest wait is reported and Retry-After covers them all.
A rejected request consumes nothing (case C18). `release(ticket, used_tokens)` ends an admitted
request and refunds its unused token reservation (streamed or not, finished or aborted).
Retry-After = ceil(wait), at least 1 s, where wait is the exact refill time of the blocking
bucket(s), so a retry after that delay succeeds when nothing else was admitted meanwhile (case
C19); for concurrency alone the end of a running request is unknown and the wait is
`concurrency_retry_after_s`. Thread-safe (one lock); time comes from the injected clock.

Also here:
- `TenantLimiter`, one tenant's state (request and token buckets, the concurrency count) and
  its checks. A check changes nothing but the buckets' refill; `admit` charges one request and
  `prompt_tokens + max_tokens` tokens and counts one running request; `release` un-counts it
  and reconciles the token charge with the real usage (unused tokens refunded, overuse charged
  as a debt). Time is an argument (seconds). A tenant without any limit (`unlimited`, fixed at
  creation: the default tenant without `--tenants`) has nothing to check or charge, so the
  controller only counts its running and admitted requests, without asking its limiter; the
  decisions, tickets and stats are those the checks would give.
- The injected clocks (`Clock`, `SystemClock`, `FakeClock`): admission code (and the router's
  policies) read time only through a `Clock`, so tests are exact. Invariant: `monotonic()`
  never decreases (FakeClock refuses to go back). This module imports no other admission
  policy, so the overload (and breaker) and precision modules import the clock from here.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sits.admission.decision import (
    AdmissionDecision,
    AdmissionTicket,
    RateLimitSnapshot,
    RejectReason,
)
from sits.admission.token_bucket import EPS_UNITS, TokenBucket
from sits.core.errors import InvalidParameterError
from sits.tenancy.config import TenantConfig, TenantsConfig


class Clock(Protocol):
    """A source of monotonic time in seconds (arbitrary origin)."""

    def monotonic(self) -> float:
        """Seconds since an arbitrary fixed origin; never decreases."""
        ...


class SystemClock:
    """The process's monotonic clock (`time.monotonic`)."""

    __slots__ = ()

    def monotonic(self) -> float:
        """`time.monotonic()` in seconds."""
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to (tests).

    Args:
        start_s: the initial time in seconds.
    """

    __slots__ = ("_now_s",)

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def monotonic(self) -> float:
        """The current fake time in seconds."""
        return self._now_s

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` (>= 0) and return the new time.

        Raises:
            ValueError: `seconds` < 0.
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now_s += seconds
        return self._now_s

    def set(self, now_s: float) -> None:
        """Jump to `now_s` (>= the current time).

        Raises:
            ValueError: `now_s` is before the current time.
        """
        if now_s < self._now_s:
            raise ValueError(f"a monotonic clock cannot go back ({self._now_s} -> {now_s})")
        self._now_s = float(now_s)


# Per-minute limits refill over this window.
MINUTE_S = 60.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request cannot be admitted now.

    Attributes:
        reason: the limit at fault.
        message: human-readable explanation.
        wait_s: seconds until the request would pass, for retryable reasons; None otherwise.
        param: the request parameter at fault for non-retryable reasons.
    """

    reason: RejectReason
    message: str
    wait_s: float | None = None
    param: str | None = None


@dataclass(slots=True)
class TenantLimiter:
    """Mutable admission state of one tenant.

    Attributes:
        tenant: the tenant's configuration.
        requests: bucket of requests_per_minute (None: unlimited).
        tokens: bucket of tokens_per_minute (None: unlimited).
        num_running: admitted requests not yet released.
        reserved_tokens: tokens held by running requests (prompt + max_tokens each).
        num_admitted: requests admitted since start.
        num_rejected: rejections since start, by reason.
        unlimited: the tenant has no limit at all (no rate, concurrency or per-request limit):
            no check can refuse it and nothing is charged (see the module docstring).
    """

    tenant: TenantConfig
    requests: TokenBucket | None
    tokens: TokenBucket | None
    unlimited: bool = False
    num_running: int = 0
    reserved_tokens: int = 0
    num_admitted: int = 0
    num_rejected: dict[RejectReason, int] = field(default_factory=dict)

    @classmethod
    def create(cls, tenant: TenantConfig, now_s: float, period_s: float = MINUTE_S):
        """Full buckets for the tenant's per-minute limits (refilled over `period_s`)."""
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        limits = (
            rpm,
            tpm,
            tenant.max_concurrent,
            tenant.max_tokens_per_request,
            tenant.max_prompt_tokens,
        )
        return cls(
            tenant=tenant,
            requests=None if rpm is None else TokenBucket.full(rpm, period_s, now_s),
            tokens=None if tpm is None else TokenBucket.full(tpm, period_s, now_s),
            unlimited=all(limit is None for limit in limits),
        )

    def check_request_size(self, prompt_tokens: int, max_tokens: int) -> Refusal | None:
        """Per-request limits that no wait can lift (HTTP 400), else None."""
        t = self.tenant
        if t.max_prompt_tokens is not None and prompt_tokens > t.max_prompt_tokens:
            return Refusal(
                RejectReason.MAX_PROMPT_TOKENS,
                f"The prompt has {prompt_tokens} tokens; tenant '{t.id}' allows at most "
                f"{t.max_prompt_tokens}.",
                param="prompt",
            )
        if t.max_tokens_per_request is not None and max_tokens > t.max_tokens_per_request:
            return Refusal(
                RejectReason.MAX_TOKENS_PER_REQUEST,
                f"The request may generate up to {max_tokens} tokens (max_tokens x n, over all "
                f"its prompts); tenant '{t.id}' allows at most {t.max_tokens_per_request} per "
                "request.",
                param="max_tokens",
            )
        total = prompt_tokens + max_tokens
        if t.tokens_per_minute is not None and total > t.tokens_per_minute:
            prompt_alone = prompt_tokens >= t.tokens_per_minute
            return Refusal(
                RejectReason.REQUEST_TOO_LARGE,
                f"Request too large: {prompt_tokens} prompt tokens + {max_tokens} for the "
                f"completion (max_tokens x n) = {total} tokens exceeds tenant '{t.id}''s limit "
                f"of {t.tokens_per_minute} tokens per minute; "
                + ("shorten the prompt." if prompt_alone else "lower max_tokens."),
                param="prompt" if prompt_alone else "max_tokens",
            )
        return None

    def check_rate(
        self, total_tokens: int, now_s: float, concurrency_wait_s: float
    ) -> Refusal | None:
        """The limit that blocks `total_tokens` now, with the longest wait (ties: concurrency,
        then requests, then tokens), else None. Changes nothing but the refill."""
        t = self.tenant
        waits: list[tuple[float, RejectReason, str]] = []
        if t.max_concurrent is not None and self.num_running >= t.max_concurrent:
            what = f"{self.num_running} requests running, limit {t.max_concurrent}"
            waits.append((concurrency_wait_s, RejectReason.CONCURRENCY, what))
        if self.requests is not None:
            wait_s = self.requests.seconds_until(1, now_s)
            if wait_s > 0:
                what = f"requests per minute, limit {t.requests_per_minute}"
                waits.append((wait_s, RejectReason.REQUESTS, what))
        if self.tokens is not None:
            wait_s = self.tokens.seconds_until(total_tokens, now_s)
            if wait_s > 0:
                what = (
                    f"tokens per minute, limit {t.tokens_per_minute}, requested {total_tokens}, "
                    f"available {max(0, int(self.tokens.level))}"
                )
                waits.append((wait_s, RejectReason.TOKENS, what))
        if not waits:
            return None
        wait_s, reason, what = max(waits, key=lambda w: w[0])
        message = f"Rate limit reached for tenant '{t.id}' ({what})."
        return Refusal(reason, message, wait_s=wait_s)

    def admit(self, total_tokens: int, now_s: float) -> int:
        """Charge one request and `total_tokens`; returns the tokens reserved (0 if no token
        limit)."""
        if self.requests is not None:
            self.requests.take(1, now_s)
        reserved = 0
        if self.tokens is not None:
            self.tokens.take(total_tokens, now_s)
            reserved = total_tokens
        self.num_running += 1
        self.reserved_tokens += reserved
        self.num_admitted += 1
        return reserved

    def release(self, reserved_tokens: int, used_tokens: int, now_s: float) -> None:
        """End a running request: refund `reserved_tokens - used_tokens` (or charge the overuse)."""
        assert self.num_running > 0, "release without a running request"
        self.num_running -= 1
        self.reserved_tokens -= reserved_tokens
        if self.tokens is None:
            return
        unused = reserved_tokens - used_tokens
        if unused > 0:
            self.tokens.give_back(unused, now_s)
        elif unused < 0:
            self.tokens.take(-unused, now_s)

    def count_rejection(self, reason: RejectReason) -> None:
        """Add one rejection for `reason` to the counters."""
        self.num_rejected[reason] = self.num_rejected.get(reason, 0) + 1

    def snapshot(self, now_s: float) -> RateLimitSnapshot:
        """The tenant's rate-limit header values at `now_s`."""
        values: dict[str, object] = {}
        for name, bucket, limit in (
            ("requests", self.requests, self.tenant.requests_per_minute),
            ("tokens", self.tokens, self.tenant.tokens_per_minute),
        ):
            if bucket is None:
                continue
            values[f"limit_{name}"] = limit
            values[f"remaining_{name}"] = max(0, math.floor(bucket.available(now_s) + EPS_UNITS))
            values[f"reset_{name}_s"] = bucket.seconds_until_full(now_s)
        return RateLimitSnapshot(**values)


_WAIT_EPS_S = 1e-9
# The rate-limit view of a tenant without rate limits (what `TenantLimiter.snapshot` gives).
_NO_RATE_LIMITS = RateLimitSnapshot()


@dataclass(frozen=True, slots=True)
class TenantAdmissionStats:
    """Counters of one tenant (for metrics).

    Attributes:
        num_running: admitted requests not yet released.
        reserved_tokens: tokens reserved by running requests.
        num_admitted: requests admitted since start.
        num_rejected: rejections since start, by reason value ("requests", "tokens", ...).
    """

    num_running: int
    reserved_tokens: int
    num_admitted: int
    num_rejected: Mapping[str, int]


def ceil_wait(wait_s: float) -> tuple[int, int]:
    """(whole seconds, milliseconds) covering `wait_s`, each rounded up and at least 1."""
    seconds = max(1, math.ceil(wait_s - _WAIT_EPS_S))
    millis = max(1, math.ceil(wait_s * 1000 - _WAIT_EPS_S * 1000))
    return seconds, millis


def _refused(limiter: TenantLimiter, refusal: Refusal, now_s: float) -> AdmissionDecision:
    """The decision of a refusal, counted: Retry-After from its wait when retryable."""
    limiter.count_rejection(refusal.reason)
    retry_s = retry_ms = None
    if refusal.wait_s is not None:
        retry_s, retry_ms = ceil_wait(refusal.wait_s)
    return AdmissionDecision(
        ticket=None,
        rate_limits=limiter.snapshot(now_s),
        reason=refusal.reason,
        retry_after_s=retry_s,
        retry_after_ms=retry_ms,
        message=refusal.message,
        param=refusal.param,
    )


class AdmissionController:
    """Admits or rejects requests per tenant; hands out tickets to give back at the end.

    Args:
        tenants: every tenant (their limits); unknown tenant ids raise KeyError.
        clock: time source (default: `SystemClock`).
        period_s: refill window of the per-minute limits (60; other values for experiments).
        concurrency_retry_after_s: Retry-After for a concurrency rejection, >= 1.
    """

    def __init__(
        self,
        tenants: TenantsConfig,
        clock: Clock | None = None,
        *,
        period_s: float = MINUTE_S,
        concurrency_retry_after_s: int = 1,
    ) -> None:
        if concurrency_retry_after_s < 1:
            raise InvalidParameterError(
                "concurrency_retry_after_s", f"must be >= 1, got {concurrency_retry_after_s}"
            )
        self._clock = clock or SystemClock()
        self._concurrency_wait_s = float(concurrency_retry_after_s)
        now_s = self._clock.monotonic()
        self._limiters = {t.id: TenantLimiter.create(t, now_s, period_s) for t in tenants}
        self._active: dict[int, AdmissionTicket] = {}
        self._next_ticket_id = 0
        self._lock = threading.Lock()

    def check_request_size(
        self, tenant: TenantConfig | str, prompt_tokens: int, max_tokens: int
    ) -> AdmissionDecision | None:
        """The 400 refusal of a request that no wait can admit (`try_admit`'s first group),
        counted as a rejection, or None; consumes nothing. The server asks this before any
        overload decision, so a request that can never run is told so instead of being shed
        with a Retry-After."""
        limiter = self._limiter(tenant)
        if limiter.unlimited:
            return None
        with self._lock:
            refusal = limiter.check_request_size(prompt_tokens, max_tokens)
            if refusal is None:
                return None
            limiter.count_rejection(refusal.reason)
            return AdmissionDecision(
                ticket=None,
                rate_limits=limiter.snapshot(self._clock.monotonic()),
                reason=refusal.reason,
                message=refusal.message,
                param=refusal.param,
            )

    def try_admit(
        self, tenant: TenantConfig | str, prompt_tokens: int, max_tokens: int
    ) -> AdmissionDecision:
        """Admit a request of `prompt_tokens` that may generate up to `max_tokens`.

        Args:
            tenant: the tenant (or its id).
            prompt_tokens: prompt length in tokens, >= 0.
            max_tokens: the request's resolved completion limit in tokens, >= 0 (the server
                resolves an unset max_tokens before calling).

        Returns:
            admitted (with a ticket) or rejected (reason, retry_after_s/ms when retryable);
            either way the tenant's rate-limit snapshot after the decision.

        Raises:
            InvalidParameterError: a negative token count.
            KeyError: an unknown tenant.
        """
        if prompt_tokens < 0 or max_tokens < 0:
            raise InvalidParameterError(
                "max_tokens", f"token counts must be >= 0, got {prompt_tokens}, {max_tokens}"
            )
        with self._lock:
            limiter = self._limiter(tenant)
            now_s = self._clock.monotonic()
            if limiter.unlimited:  # nothing to check or charge: count it (as `admit` does)
                limiter.num_running += 1
                limiter.num_admitted += 1
                return AdmissionDecision(self._issue(limiter, 0, now_s), _NO_RATE_LIMITS)
            total = prompt_tokens + max_tokens
            refusal = limiter.check_request_size(prompt_tokens, max_tokens)
            if refusal is None:
                refusal = limiter.check_rate(total, now_s, self._concurrency_wait_s)
            if refusal is not None:
                return _refused(limiter, refusal, now_s)
            reserved = limiter.admit(total, now_s)
            ticket = self._issue(limiter, reserved, now_s)
            return AdmissionDecision(ticket=ticket, rate_limits=limiter.snapshot(now_s))

    def precheck(self, tenant: TenantConfig | str) -> AdmissionDecision | None:
        """The refusal every request of `tenant` would get now, whatever its size (its
        concurrency is full, or its request or token bucket cannot give one more), counted
        as a rejection; None when some request could be admitted. Lets the server refuse
        before it tokenizes: during a flood of refused requests the tokenizer then only
        works for requests that can run. Charges nothing.

        Raises:
            KeyError: an unknown tenant.
        """
        with self._lock:
            limiter = self._limiter(tenant)
            if limiter.unlimited:
                return None
            now_s = self._clock.monotonic()
            refusal = limiter.check_rate(1, now_s, self._concurrency_wait_s)
            return None if refusal is None else _refused(limiter, refusal, now_s)

    def _issue(self, limiter: TenantLimiter, reserved_tokens: int, now_s: float) -> AdmissionTicket:
        """A new ticket of an admitted request, kept until `release` (call under the lock)."""
        ticket = AdmissionTicket(self._next_ticket_id, limiter.tenant.id, reserved_tokens, now_s)
        self._next_ticket_id += 1
        self._active[ticket.ticket_id] = ticket
        return ticket

    def release(self, ticket: AdmissionTicket, used_tokens: int) -> bool:
        """End an admitted request: free its concurrency slot and reconcile its tokens.

        Args:
            ticket: from the admitting decision.
            used_tokens: prompt + completion tokens the request really consumed (>= 0); the
                unused part of the reservation is refunded, any overuse is charged.

        Returns:
            True; False when this ticket was already released (idempotent, safe in `finally`).
        """
        with self._lock:
            if self._active.pop(ticket.ticket_id, None) is None:
                return False
            limiter = self._limiters[ticket.tenant_id]
            if limiter.unlimited:  # nothing reserved, no bucket to reconcile
                assert limiter.num_running > 0, "release without a running request"
                limiter.num_running -= 1
                return True
            limiter.release(ticket.reserved_tokens, max(0, used_tokens), self._clock.monotonic())
            return True

    def snapshot(self, tenant: TenantConfig | str) -> RateLimitSnapshot:
        """The tenant's rate-limit header values now (for responses not decided here)."""
        with self._lock:
            return self._limiter(tenant).snapshot(self._clock.monotonic())

    def stats(self, tenant: TenantConfig | str) -> TenantAdmissionStats:
        """The tenant's counters now."""
        with self._lock:
            lim = self._limiter(tenant)
            rejected = {reason.value: n for reason, n in lim.num_rejected.items()}
            return TenantAdmissionStats(
                lim.num_running, lim.reserved_tokens, lim.num_admitted, rejected
            )

    def _limiter(self, tenant: TenantConfig | str) -> TenantLimiter:
        tenant_id = tenant if isinstance(tenant, str) else tenant.id
        limiter = self._limiters.get(tenant_id)
        if limiter is None:
            raise KeyError(f"unknown tenant {tenant_id!r}")
        return limiter
