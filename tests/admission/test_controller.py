"""AdmissionController: cases C18 and C19, reservations and refunds, 400 limits, headers."""

from __future__ import annotations

import pytest

from sits.admission import (
    AdmissionController,
    AdmissionTicket,
    FakeClock,
    RateLimitSnapshot,
    RejectReason,
    ratelimit_headers,
)
from sits.admission.controller import TenantLimiter
from sits.core.errors import InvalidParameterError
from sits.tenancy import TenantConfig, TenantsConfig, hash_api_key


def _controller(clock: FakeClock, **limits: int) -> AdmissionController:
    tenant = TenantConfig(id="t", api_key_sha256=(hash_api_key("k"),), **limits)
    return AdmissionController(TenantsConfig((tenant,)), clock)


def test_c18_rejected_request_consumes_nothing() -> None:
    clock = FakeClock()
    ctl = _controller(clock, max_concurrent=1, requests_per_minute=2)
    a = ctl.try_admit("t", prompt_tokens=10, max_tokens=5)
    assert a.admitted and a.http_status == 200
    clock.set(5.0)
    b = ctl.try_admit("t", 10, 5)
    assert (b.admitted, b.reason, b.http_status) == (False, RejectReason.CONCURRENCY, 429)
    assert (b.retry_after_s, b.retry_after_ms) == (1, 1000)
    clock.set(10.0)
    assert ctl.release(a.ticket, used_tokens=15)
    clock.set(15.0)
    c = ctl.try_admit("t", 10, 5)
    # Had B consumed a request, only 0.5 would be left now and C would be refused.
    assert c.admitted
    # The minute counter shows 2 used (0.5 refilled over 15 s, floored): 2 of 2, not 3.
    assert c.rate_limits == RateLimitSnapshot(2, 0, 45.0)
    stats = ctl.stats("t")
    assert (stats.num_admitted, stats.num_running, dict(stats.num_rejected)) == (
        2,
        1,
        {"concurrency": 1},
    )


def test_c19_retry_after_is_an_integer_and_a_retry_then_succeeds() -> None:
    clock = FakeClock(1000.0)
    ctl = _controller(clock, requests_per_minute=2)
    assert ctl.try_admit("t", 1, 1).admitted
    assert ctl.try_admit("t", 1, 1).admitted
    rejected = ctl.try_admit("t", 1, 1)
    assert (rejected.reason, rejected.http_status) == (RejectReason.REQUESTS, 429)
    assert (rejected.retry_after_s, rejected.retry_after_ms) == (30, 30000)
    assert ratelimit_headers(rejected) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "Retry-After": "30",
        "retry-after-ms": "30000",
    }
    clock.advance(29.0)
    early = ctl.try_admit("t", 1, 1)
    assert (early.admitted, early.retry_after_s) == (False, 1)
    clock.advance(1.0)
    assert ctl.try_admit("t", 1, 1).admitted
    assert dict(ctl.stats("t").num_rejected) == {"requests": 2}


def test_c19_token_limit_wait_is_rounded_up_and_sufficient() -> None:
    clock = FakeClock()
    ctl = _controller(clock, tokens_per_minute=1000)
    assert ctl.try_admit("t", 100, 500).admitted  # 400 tokens left
    clock.set(1.0)  # + 16.67 tokens
    rejected = ctl.try_admit("t", 100, 500)
    assert rejected.reason is RejectReason.TOKENS
    # 183.33 tokens missing at 16.67 tokens/s: 11 s.
    assert (rejected.retry_after_s, rejected.retry_after_ms) == (11, 11000)
    assert rejected.rate_limits.remaining_tokens == 416
    clock.advance(rejected.retry_after_ms / 1000)
    assert ctl.try_admit("t", 100, 500).admitted


def test_longest_blocking_wait_is_reported() -> None:
    clock = FakeClock()
    ctl = _controller(clock, requests_per_minute=2, tokens_per_minute=1000)
    assert ctl.try_admit("t", 0, 750).admitted
    assert ctl.try_admit("t", 0, 0).admitted
    rejected = ctl.try_admit("t", 0, 1000)
    # requests: 30 s; tokens: 750 missing at 1000/60 per s = 45 s.
    assert (rejected.reason, rejected.retry_after_s) == (RejectReason.TOKENS, 45)
    clock.advance(45)
    assert ctl.try_admit("t", 0, 1000).admitted


def test_release_refunds_the_unused_reservation() -> None:
    clock = FakeClock()
    ctl = _controller(clock, tokens_per_minute=1000)
    d = ctl.try_admit("t", prompt_tokens=100, max_tokens=400)
    assert d.ticket.reserved_tokens == 500
    assert d.rate_limits.remaining_tokens == 500
    assert ctl.stats("t").reserved_tokens == 500
    assert ctl.release(d.ticket, used_tokens=150)
    assert ctl.snapshot("t").remaining_tokens == 850
    assert ctl.stats("t").reserved_tokens == 0
    assert not ctl.release(d.ticket, used_tokens=0)  # idempotent: no second refund
    assert ctl.snapshot("t").remaining_tokens == 850


def test_overuse_is_charged_and_refund_is_capped() -> None:
    clock = FakeClock()
    ctl = _controller(clock, tokens_per_minute=1000)
    d = ctl.try_admit("t", 100, 400)
    ctl.release(d.ticket, used_tokens=600)
    assert ctl.snapshot("t").remaining_tokens == 400
    d = ctl.try_admit("t", 0, 100)
    clock.advance(60.0)  # bucket full again
    ctl.release(d.ticket, used_tokens=0)
    assert ctl.snapshot("t").remaining_tokens == 1000


def test_admitted_headers_show_the_reservation() -> None:
    clock = FakeClock()
    ctl = _controller(clock, requests_per_minute=2, tokens_per_minute=1000)
    d = ctl.try_admit("t", 100, 400)
    assert ratelimit_headers(d) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "30s",
    }


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "reason", "param"),
    [
        (101, 1, RejectReason.MAX_PROMPT_TOKENS, "prompt"),
        (10, 51, RejectReason.MAX_TOKENS_PER_REQUEST, "max_tokens"),
        (100, 50, RejectReason.REQUEST_TOO_LARGE, "max_tokens"),
    ],
)
def test_per_request_limits_are_400_and_consume_nothing(prompt, max_tokens, reason, param):
    clock = FakeClock()
    ctl = _controller(
        clock,
        max_prompt_tokens=100,
        max_tokens_per_request=50,
        tokens_per_minute=120,
        requests_per_minute=1,
    )
    d = ctl.try_admit("t", prompt, max_tokens)
    assert (d.reason, d.param, d.http_status) == (reason, param, 400)
    if reason is RejectReason.MAX_TOKENS_PER_REQUEST:  # max_tokens x n, as the user sent it
        assert d.message.startswith("The request may generate up to 51 tokens (max_tokens x n")
    assert (d.retry_after_s, d.retry_after_ms) == (None, None)
    assert "Retry-After" not in ratelimit_headers(d)
    assert ctl.snapshot("t") == RateLimitSnapshot(1, 1, 0.0, 120, 120, 0.0)
    assert ctl.try_admit("t", 100, 20).admitted


def test_unlimited_tenant_is_always_admitted() -> None:
    ctl = AdmissionController(TenantsConfig.default(), FakeClock())
    decisions = [ctl.try_admit("default", 10_000, 10_000) for _ in range(100)]
    assert all(d.admitted for d in decisions)
    assert ratelimit_headers(decisions[-1]) == {}
    assert decisions[-1].ticket.reserved_tokens == 0
    assert ctl.stats("default").num_running == 100


def test_unlimited_tenant_is_served_without_its_limiter(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object) -> None:
        raise AssertionError("the limiter of a tenant without limits was asked")

    for name in ("check_request_size", "check_rate", "admit", "release", "snapshot"):
        monkeypatch.setattr(TenantLimiter, name, never)
    clock = FakeClock(2.0)
    ctl = AdmissionController(TenantsConfig.default(), clock)
    assert ctl.check_request_size("default", 10**9, 10**9) is None
    first = ctl.try_admit("default", 10, 5)
    clock.set(3.5)
    second = ctl.try_admit("default", 10**9, 10**9)
    assert first.rate_limits == second.rate_limits == RateLimitSnapshot()
    assert (first.ticket, second.ticket) == (
        AdmissionTicket(0, "default", 0, 2.0),
        AdmissionTicket(1, "default", 0, 3.5),
    )
    stats = ctl.stats("default")
    assert (stats.num_running, stats.reserved_tokens, stats.num_admitted) == (2, 0, 2)
    assert stats.num_rejected == {}
    assert ctl.release(first.ticket, used_tokens=15) and not ctl.release(first.ticket, 15)
    assert ctl.stats("default").num_running == 1
    with pytest.raises(InvalidParameterError):
        ctl.try_admit("default", -1, 1)


@pytest.mark.parametrize(
    "limit",
    [
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent",
        "max_tokens_per_request",
        "max_prompt_tokens",
    ],
)
def test_any_one_limit_makes_the_limiter_check(limit: str) -> None:
    assert TenantLimiter.create(TenantConfig(id="t"), 0.0).unlimited
    assert not TenantLimiter.create(TenantConfig(id="t", **{limit: 1}), 0.0).unlimited


def test_bad_inputs() -> None:
    ctl = _controller(FakeClock())
    with pytest.raises(KeyError, match="nobody"):
        ctl.try_admit("nobody", 1, 1)
    with pytest.raises(InvalidParameterError):
        ctl.try_admit("t", -1, 1)
    with pytest.raises(InvalidParameterError):
        AdmissionController(TenantsConfig.default(), concurrency_retry_after_s=0)


def test_precheck_refuses_what_any_request_would_get_and_charges_nothing() -> None:
    """`precheck` (before tokenization) refuses exactly when no request of the tenant could
    be admitted now: an empty request bucket, an empty token bucket, full concurrency; it
    counts the rejection as `try_admit` would and charges no bucket."""
    clock = FakeClock()
    ctl = _controller(clock, requests_per_minute=1, tokens_per_minute=100, max_concurrent=2)
    assert ctl.precheck("t") is None  # full buckets: some request fits
    a = ctl.try_admit("t", 10, 5)
    assert a.admitted
    refused = ctl.precheck("t")  # the one request of this minute is taken
    assert refused is not None and refused.reason is RejectReason.REQUESTS
    assert (refused.http_status, refused.retry_after_s) == (429, 60)
    assert ctl.stats("t").num_rejected == {RejectReason.REQUESTS: 1}
    clock.set(60.0)  # refilled: the precheck charged nothing
    assert ctl.precheck("t") is None
    assert ctl.try_admit("t", 10, 5).admitted
    clock.set(120.0)
    tokens = _controller(clock, tokens_per_minute=10)
    assert tokens.try_admit("t", 4, 6).admitted  # all 10 tokens reserved
    assert tokens.precheck("t").reason is RejectReason.TOKENS
    unlimited = AdmissionController(TenantsConfig.default(), clock)
    assert unlimited.precheck("default") is None
