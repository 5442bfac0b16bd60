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
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from sits.admission.clock import Clock, SystemClock
from sits.admission.decision import (
    AdmissionDecision,
    AdmissionTicket,
    RateLimitSnapshot,
)
from sits.admission.limiter import MINUTE_S, TenantLimiter
from sits.core.errors import InvalidParameterError
from sits.tenancy.config import TenantConfig, TenantsConfig

_WAIT_EPS_S = 1e-9


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
        with self._lock:
            limiter = self._limiter(tenant)
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
            total = prompt_tokens + max_tokens
            refusal = limiter.check_request_size(prompt_tokens, max_tokens)
            if refusal is None:
                refusal = limiter.check_rate(total, now_s, self._concurrency_wait_s)
            if refusal is not None:
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
            reserved = limiter.admit(total, now_s)
            ticket = AdmissionTicket(self._next_ticket_id, limiter.tenant.id, reserved, now_s)
            self._next_ticket_id += 1
            self._active[ticket.ticket_id] = ticket
            return AdmissionDecision(ticket=ticket, rate_limits=limiter.snapshot(now_s))

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
