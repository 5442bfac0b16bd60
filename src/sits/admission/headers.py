"""HTTP header values for rate limits, in OpenAI's names and formats.

`x-ratelimit-{limit,remaining,reset}-{requests,tokens}` go on every response of a limited
tenant (a dimension without a limit is omitted); rejections add `Retry-After` (integer seconds,
RFC 9110) and `retry-after-ms` (which the official OpenAI client prefers). Reset times use Go's
duration format as OpenAI does: "0s", "250ms", "1s", "1.5s", "6m0s", "1h0m0s".
"""

from __future__ import annotations

import math

from sits.admission.decision import AdmissionDecision, RateLimitSnapshot

_MS_EPS = 1e-6


def format_reset(seconds: float) -> str:
    """Go-style duration of `seconds`, rounded up to the millisecond.

    Below one second: whole milliseconds ("250ms"); else hours and minutes when non-zero (and
    minutes whenever hours are) and seconds with up to 3 decimals ("1m30.5s", "6m0s").
    """
    if seconds <= 0:
        return "0s"
    total_ms = max(1, math.ceil(seconds * 1000 - _MS_EPS))
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole_s, frac_ms = divmod(rest_ms, 1000)
    secs = f"{whole_s}" if frac_ms == 0 else f"{whole_s}.{frac_ms:03d}".rstrip("0")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return f"{out}{secs}s"


def snapshot_headers(snapshot: RateLimitSnapshot) -> dict[str, str]:
    """The x-ratelimit-* headers of a snapshot (only the limited dimensions)."""
    headers: dict[str, str] = {}
    s = snapshot
    dims = (
        ("requests", s.limit_requests, s.remaining_requests, s.reset_requests_s),
        ("tokens", s.limit_tokens, s.remaining_tokens, s.reset_tokens_s),
    )
    for name, limit, remaining, reset_s in dims:
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{name}"] = str(limit)
        headers[f"x-ratelimit-remaining-{name}"] = str(remaining)
        headers[f"x-ratelimit-reset-{name}"] = format_reset(reset_s or 0.0)
    return headers


def retry_after_headers(retry_after_s: int, retry_after_ms: int | None = None) -> dict[str, str]:
    """`Retry-After` (integer seconds) and `retry-after-ms` (defaults to retry_after_s * 1000).

    Also for 503s (overload shedding, open circuit breaker).
    """
    ms = retry_after_s * 1000 if retry_after_ms is None else retry_after_ms
    return {"Retry-After": str(retry_after_s), "retry-after-ms": str(ms)}


def ratelimit_headers(source: AdmissionDecision | RateLimitSnapshot) -> dict[str, str]:
    """Headers for a response: the x-ratelimit-* values, plus Retry-After / retry-after-ms when
    `source` is a retryable rejection."""
    if isinstance(source, RateLimitSnapshot):
        return snapshot_headers(source)
    headers = snapshot_headers(source.rate_limits)
    if source.retry_after_s is not None:
        headers.update(retry_after_headers(source.retry_after_s, source.retry_after_ms))
    return headers
