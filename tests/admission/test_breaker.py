"""Circuit breaker: every transition, with a fake clock."""

from __future__ import annotations

import pytest

from sits.admission import BreakerConfig, BreakerDecision, BreakerState, CircuitBreaker, FakeClock
from sits.core.errors import InvalidParameterError

CLOSED, OPEN, HALF = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN


def _breaker(**config: float) -> tuple[CircuitBreaker, FakeClock]:
    clock = FakeClock()
    return CircuitBreaker(BreakerConfig(**config), clock), clock


def _record(breaker: CircuitBreaker, pattern: str) -> None:
    for ch in pattern:
        breaker.record_failure() if ch == "F" else breaker.record_success()


def test_consecutive_failures_open_below_min_samples() -> None:
    breaker, _ = _breaker()
    _record(breaker, "FFFF")
    assert breaker.state is CLOSED
    breaker.record_failure()
    assert breaker.state is OPEN
    assert breaker.num_opened == 1


def test_a_success_resets_the_consecutive_count() -> None:
    breaker, _ = _breaker()
    _record(breaker, "FFFFSFFFF")  # 8 of 9 failed, under min_samples=10, never 5 in a row
    assert breaker.state is CLOSED
    assert breaker.window_counts() == (9, 8)
    breaker.record_success()  # 10 samples, 80 % failed
    assert breaker.state is OPEN


def test_ratio_must_exceed_thirty_percent() -> None:
    breaker, _ = _breaker()
    _record(breaker, "SSFSSFSSFS")  # exactly 30 % of 10
    assert breaker.state is CLOSED
    breaker.record_failure()  # 4 of 11 = 36 %
    assert breaker.state is OPEN


def test_old_outcomes_leave_the_window() -> None:
    breaker, clock = _breaker()
    _record(breaker, "FFF")
    clock.set(30.0)
    _record(breaker, "SSSSSS")
    assert breaker.window_counts() == (9, 3)
    clock.set(60.0)  # the three failures at t=0 are now 60 s old: out
    assert breaker.window_counts() == (6, 0)
    _record(breaker, "FFSSFF")
    assert breaker.window_counts() == (12, 4)
    assert breaker.state is OPEN  # 4 of 12 = 33 % > 30 %, never 5 in a row
    breaker2, clock2 = _breaker()
    _record(breaker2, "FFF")
    clock2.set(61.0)
    _record(breaker2, "SSSSSSSFF")  # 2 of 9 after the old failures left
    assert breaker2.window_counts() == (9, 2)
    assert breaker2.state is CLOSED


def test_open_fails_fast_then_half_open_probe_closes() -> None:
    breaker, clock = _breaker()
    clock.set(100.0)
    _record(breaker, "FFFFF")
    assert breaker.allow() == BreakerDecision(False, 30)
    clock.set(110.5)
    assert breaker.allow() == BreakerDecision(False, 20)
    breaker.record_success()  # ignored while open
    assert breaker.state is OPEN
    clock.set(130.0)
    assert breaker.state is HALF
    assert breaker.allow() == BreakerDecision(True, None, is_probe=True)
    assert breaker.allow() == BreakerDecision(False, 1)
    breaker.record_success()
    assert breaker.state is CLOSED
    assert breaker.window_counts() == (0, 0)
    assert breaker.allow() == BreakerDecision(True)
    _record(breaker, "FFFF")
    assert breaker.state is CLOSED  # the consecutive count restarted at close


def test_failed_probe_reopens_for_a_full_period() -> None:
    breaker, clock = _breaker(open_s=10.0)
    _record(breaker, "FFFFF")
    clock.set(10.0)
    assert breaker.allow().is_probe
    clock.set(12.0)
    breaker.record_failure()
    assert breaker.state is OPEN
    assert breaker.allow() == BreakerDecision(False, 10)
    clock.set(21.9)
    assert breaker.state is OPEN
    clock.set(22.0)
    assert breaker.state is HALF
    assert breaker.num_opened == 2


def test_released_or_silent_probe_is_replaced() -> None:
    breaker, clock = _breaker(open_s=10.0, probe_timeout_s=5.0)
    _record(breaker, "FFFFF")
    clock.set(10.0)
    assert breaker.allow().is_probe
    breaker.release_probe()
    assert breaker.allow().is_probe
    clock.set(14.0)
    assert not breaker.allow().allowed
    clock.set(15.0)
    assert breaker.allow().is_probe


def test_custom_thresholds() -> None:
    breaker, _ = _breaker(max_consecutive_failures=2, failure_ratio=0.5, min_samples=4)
    _record(breaker, "FSFS")
    assert breaker.state is CLOSED  # 50 % is not > 50 %
    breaker.record_failure()
    assert breaker.state is OPEN  # 3 of 5 = 60 %


@pytest.mark.parametrize(
    "kwargs",
    [
        {"failure_ratio": 1.0},
        {"failure_ratio": -0.1},
        {"min_samples": 0},
        {"max_consecutive_failures": 0},
        {"window_s": 0.0},
        {"open_s": -1.0},
        {"probe_timeout_s": 0.0},
    ],
)
def test_config_validation(kwargs) -> None:
    with pytest.raises(InvalidParameterError) as info:
        BreakerConfig(**kwargs)
    assert info.value.param == next(iter(kwargs))
