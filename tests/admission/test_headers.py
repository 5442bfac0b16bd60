"""OpenAI rate-limit header names and formats."""

from __future__ import annotations

import pytest

from sits.admission import (
    AdmissionDecision,
    RateLimitSnapshot,
    RejectReason,
    format_reset,
    ratelimit_headers,
    retry_after_headers,
)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-3.0, "0s"),
        (0.0001, "1ms"),
        (0.25, "250ms"),
        (0.9994, "1s"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (17.25, "17.25s"),
        (59.999, "59.999s"),
        (60.0, "1m0s"),
        (90.5, "1m30.5s"),
        (360.0, "6m0s"),
        (3600.0, "1h0m0s"),
        (3725.25, "1h2m5.25s"),
    ],
)
def test_format_reset_matches_go_durations(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_snapshot_headers_exact() -> None:
    snap = RateLimitSnapshot(2, 1, 30.0, 1000, 500, 30.0)
    assert ratelimit_headers(snap) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "30s",
    }


def test_unlimited_dimensions_are_omitted() -> None:
    assert ratelimit_headers(RateLimitSnapshot()) == {}
    only_tokens = RateLimitSnapshot(limit_tokens=10, remaining_tokens=0, reset_tokens_s=6.0)
    assert ratelimit_headers(only_tokens) == {
        "x-ratelimit-limit-tokens": "10",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "6s",
    }


def test_rejection_adds_retry_after() -> None:
    snap = RateLimitSnapshot(2, 0, 60.0)
    decision = AdmissionDecision(None, snap, RejectReason.REQUESTS, 30, 29001)
    assert ratelimit_headers(decision) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "Retry-After": "30",
        "retry-after-ms": "29001",
    }
    assert decision.http_status == 429 and not decision.admitted


def test_retry_after_headers_for_503() -> None:
    assert retry_after_headers(5) == {"Retry-After": "5", "retry-after-ms": "5000"}
