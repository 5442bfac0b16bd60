"""Admission messages: the ticket of an admitted request, the decision, and the rate-limit view.

Invariants: a decision is admitted exactly when it has a ticket; a rejected decision has a
reason, and `retry_after_s` (integer >= 1) and `retry_after_ms` (>= 1) exactly when the reason
is retryable (HTTP 429). All frozen: decisions are values, safe to hand across threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RejectReason(StrEnum):
    """Why a request was refused, with the HTTP status the server answers.

    REQUESTS, TOKENS, CONCURRENCY: a rate or concurrency limit is reached now (429, retryable).
    MAX_TOKENS_PER_REQUEST, MAX_PROMPT_TOKENS: the request exceeds a per-request limit of its
        tenant (400, never retryable as is).
    REQUEST_TOO_LARGE: prompt + max_tokens exceeds the tenant's whole tokens_per_minute, so no
        wait can admit it (400).
    """

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"
    MAX_TOKENS_PER_REQUEST = "max_tokens_per_request"
    MAX_PROMPT_TOKENS = "max_prompt_tokens"
    REQUEST_TOO_LARGE = "request_too_large"

    @property
    def retryable(self) -> bool:
        """True when waiting can make the same request succeed (answered with 429)."""
        return self in (RejectReason.REQUESTS, RejectReason.TOKENS, RejectReason.CONCURRENCY)

    @property
    def http_status(self) -> int:
        """429 for retryable reasons, 400 otherwise."""
        return 429 if self.retryable else 400


@dataclass(frozen=True, slots=True)
class RateLimitSnapshot:
    """A tenant's rate-limit state at one instant (the x-ratelimit-* header values).

    A dimension without a limit has all three of its fields None (its headers are omitted).

    Attributes:
        limit_requests: requests_per_minute.
        remaining_requests: whole requests that could be admitted now (>= 0).
        reset_requests_s: seconds until the request bucket is full again.
        limit_tokens: tokens_per_minute.
        remaining_tokens: whole tokens available now (>= 0).
        reset_tokens_s: seconds until the token bucket is full again.
    """

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None


@dataclass(frozen=True, slots=True)
class AdmissionTicket:
    """Proof of admission; give it back with `AdmissionController.release` when the request ends.

    Attributes:
        ticket_id: unique per controller.
        tenant_id: the tenant charged.
        reserved_tokens: prompt_tokens + max_tokens taken from the token bucket (0 if the
            tenant has no token limit).
        admitted_s: clock time of admission, in seconds.
    """

    ticket_id: int
    tenant_id: str
    reserved_tokens: int
    admitted_s: float


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """Outcome of `AdmissionController.try_admit`.

    Attributes:
        ticket: set when admitted.
        rate_limits: the tenant's limits after this decision (a rejection consumed nothing).
        reason: set when rejected.
        retry_after_s: integer seconds >= 1 after which the same request is admitted if nothing
            else is (for CONCURRENCY, a poll interval: the end of a running request is
            unknown); None when admitted or not retryable.
        retry_after_ms: the same wait in milliseconds (>= 1, rounded up; <= retry_after_s*1000).
        message: human-readable explanation (OpenAI error body `message`).
        param: the request parameter at fault for 400 rejections ("prompt" or "max_tokens").
    """

    ticket: AdmissionTicket | None
    rate_limits: RateLimitSnapshot
    reason: RejectReason | None = None
    retry_after_s: int | None = None
    retry_after_ms: int | None = None
    message: str = ""
    param: str | None = None

    @property
    def admitted(self) -> bool:
        """True when the request may go to the engine."""
        return self.ticket is not None

    @property
    def http_status(self) -> int:
        """200 when admitted, else the reason's status (429 or 400)."""
        return 200 if self.reason is None else self.reason.http_status
