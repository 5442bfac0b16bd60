"""TokenBucket: exact refill amounts, waits, debts and caps; FakeClock."""

from __future__ import annotations

import math

import pytest

from sits.admission import FakeClock, TokenBucket


def test_refill_is_continuous_and_capped() -> None:
    bucket = TokenBucket.full(60, 60.0, now_s=0.0)
    assert bucket.try_take(60, 0.0)
    assert bucket.available(0.0) == 0.0
    assert bucket.available(0.5) == 0.5
    assert bucket.available(10.0) == 10.0
    assert bucket.available(59.0) == 59.0
    assert bucket.available(1000.0) == 60.0


def test_refill_of_a_round_limit_is_exact() -> None:
    bucket = TokenBucket.full(2, 60.0, now_s=100.0)
    assert bucket.try_take(1, 100.0) and bucket.try_take(1, 100.0)
    assert bucket.seconds_until(1, 100.0) == 30.0
    assert bucket.seconds_until_full(100.0) == 60.0
    assert not bucket.try_take(1, 129.0)
    assert bucket.available(129.0) == 29 * 2 / 60
    assert bucket.try_take(1, 130.0)
    assert bucket.available(130.0) == 0.0


def test_failed_take_changes_nothing() -> None:
    bucket = TokenBucket.full(1000, 60.0, now_s=0.0)
    assert bucket.try_take(900, 0.0)
    assert not bucket.try_take(200, 0.0)
    assert bucket.available(0.0) == 100.0
    assert bucket.seconds_until(200, 0.0) == 6.0  # 100 tokens at 1000/60 per s


def test_amount_over_capacity_never_fits() -> None:
    bucket = TokenBucket.full(10, 60.0, now_s=0.0)
    assert bucket.seconds_until(11, 0.0) == math.inf
    assert not bucket.try_take(11, 0.0)
    assert bucket.available(0.0) == 10.0


def test_debt_is_paid_back_first_and_give_back_is_capped() -> None:
    bucket = TokenBucket.full(60, 60.0, now_s=0.0)
    bucket.take(70, 0.0)
    assert bucket.available(0.0) == -10.0
    assert bucket.available(15.0) == 5.0
    bucket.give_back(100, 15.0)
    assert bucket.available(15.0) == 60.0


def test_time_going_back_adds_nothing() -> None:
    bucket = TokenBucket.full(60, 60.0, now_s=10.0)
    bucket.take(30, 10.0)
    assert bucket.available(5.0) == 30.0
    assert bucket.available(11.0) == 31.0


def test_bucket_needs_positive_capacity() -> None:
    with pytest.raises(ValueError, match="> 0"):
        TokenBucket.full(0, 60.0, now_s=0.0)


def test_fake_clock() -> None:
    clock = FakeClock(5.0)
    assert clock.monotonic() == 5.0
    assert clock.advance(2.5) == 7.5
    clock.set(9.0)
    assert clock.monotonic() == 9.0
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.set(8.0)
