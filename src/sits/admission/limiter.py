"""Per-tenant admission state: request and token buckets, the concurrency count, and checks.

Invariants: a check changes nothing but the buckets' refill (a rejected request consumes
nothing); `admit` charges one request and `prompt_tokens + max_tokens` tokens and counts one
running request; `release` un-counts it and reconciles the token charge with the real usage
(unused tokens refunded, overuse charged as a debt). Time is an argument (seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sits.admission.decision import RateLimitSnapshot, RejectReason
from sits.admission.token_bucket import EPS_UNITS, TokenBucket
from sits.tenancy.config import TenantConfig

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
    """

    tenant: TenantConfig
    requests: TokenBucket | None
    tokens: TokenBucket | None
    num_running: int = 0
    reserved_tokens: int = 0
    num_admitted: int = 0
    num_rejected: dict[RejectReason, int] = field(default_factory=dict)

    @classmethod
    def create(cls, tenant: TenantConfig, now_s: float, period_s: float = MINUTE_S):
        """Full buckets for the tenant's per-minute limits (refilled over `period_s`)."""
        rpm, tpm = tenant.requests_per_minute, tenant.tokens_per_minute
        return cls(
            tenant=tenant,
            requests=None if rpm is None else TokenBucket.full(rpm, period_s, now_s),
            tokens=None if tpm is None else TokenBucket.full(tpm, period_s, now_s),
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
