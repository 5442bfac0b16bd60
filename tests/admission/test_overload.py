"""Overload states: thresholds, immediate escalation, hysteresis, and the admission table."""

from __future__ import annotations

import pytest

from sits.admission import (
    FakeClock,
    OverloadAction,
    OverloadMonitor,
    OverloadPolicy,
    OverloadSignals,
    OverloadState,
    OverloadThresholds,
)
from sits.core.errors import InvalidParameterError
from sits.tenancy import Tier

G, Y, R = OverloadState.GREEN, OverloadState.YELLOW, OverloadState.RED


def _q(delay_s: float) -> OverloadSignals:
    return OverloadSignals(queue_delay_s=delay_s)


@pytest.mark.parametrize(
    ("signals", "state"),
    [
        (OverloadSignals(), G),
        (_q(0.99), G),
        (_q(1.0), Y),
        (_q(5.0), R),
        (OverloadSignals(kv_usage=0.89), G),
        (OverloadSignals(kv_usage=0.9), Y),
        (OverloadSignals(kv_usage=0.98), R),
        (OverloadSignals(predicted_ttft_s=0.4, min_ttft_slo_s=0.5), G),
        (OverloadSignals(predicted_ttft_s=0.5, min_ttft_slo_s=0.5), Y),
        (OverloadSignals(predicted_ttft_s=1.0, min_ttft_slo_s=0.5), R),
        (OverloadSignals(predicted_ttft_s=100.0, min_ttft_slo_s=None), G),
        (OverloadSignals(queue_delay_s=1.0, kv_usage=0.99), R),
    ],
)
def test_first_update_reaches_the_worst_signal_level(signals, state) -> None:
    monitor = OverloadMonitor(clock=FakeClock())
    assert monitor.update(signals) is state


def test_step_down_needs_a_calm_hold() -> None:
    clock = FakeClock()
    monitor = OverloadMonitor(OverloadThresholds(hold_s=5.0), clock)
    assert monitor.update(_q(1.0)) is Y
    clock.set(1.0)
    assert monitor.update(_q(0.9)) is Y  # under the entry level, above exit (0.8): no timer
    clock.set(100.0)
    assert monitor.update(_q(0.9)) is Y
    assert monitor.update(_q(0.7)) is Y  # calm from t=100
    clock.set(104.0)
    assert monitor.update(_q(0.7)) is Y
    clock.set(105.0)
    assert monitor.update(_q(0.7)) is G
    assert monitor.state_since_s == 105.0


def test_a_break_in_the_calm_restarts_the_hold() -> None:
    clock = FakeClock()
    monitor = OverloadMonitor(OverloadThresholds(hold_s=5.0), clock)
    monitor.update(_q(2.0))
    for t, delay in ((0.0, 0.5), (3.0, 0.85), (4.0, 0.5), (8.0, 0.5)):
        clock.set(t)
        assert monitor.update(_q(delay)) is Y
    clock.set(9.0)
    assert monitor.update(_q(0.5)) is G


def test_red_steps_down_one_level_per_hold() -> None:
    clock = FakeClock()
    monitor = OverloadMonitor(OverloadThresholds(hold_s=5.0), clock)
    assert monitor.update(_q(5.0)) is R
    clock.set(1.0)
    assert monitor.update(_q(0.0)) is R
    clock.set(6.0)
    assert monitor.update(_q(0.0)) is Y
    clock.set(10.0)
    assert monitor.update(_q(0.0)) is Y
    clock.set(11.0)
    assert monitor.update(_q(0.0)) is G


def test_red_holds_while_above_its_exit_level_and_stops_at_yellow() -> None:
    clock = FakeClock()
    monitor = OverloadMonitor(OverloadThresholds(hold_s=5.0), clock)
    monitor.update(_q(6.0))
    for t in range(1, 60):
        clock.set(float(t))
        assert monitor.update(_q(4.5)) is R  # exit level of red: 0.8 * 5 = 4
    for t in range(60, 66):
        clock.set(float(t))
        monitor.update(_q(3.0))
    assert monitor.state is Y
    clock.set(500.0)
    assert monitor.update(_q(3.0)) is Y  # 3.0 >= 0.8 * 1.0: never green


def test_escalation_is_immediate_even_during_a_calm_hold() -> None:
    clock = FakeClock()
    monitor = OverloadMonitor(OverloadThresholds(hold_s=5.0), clock)
    monitor.update(_q(1.0))
    clock.set(1.0)
    monitor.update(_q(0.0))
    clock.set(4.0)
    assert monitor.update(OverloadSignals(kv_usage=0.99)) is R
    assert monitor.state_since_s == 4.0


def test_oscillating_load_does_not_flap() -> None:
    clock = FakeClock()
    monitor = OverloadMonitor(OverloadThresholds(hold_s=5.0), clock)
    states = []
    for t in range(40):
        clock.set(float(t))
        states.append(monitor.update(_q(1.05 if t % 2 == 0 else 0.75)))
    assert states == [Y] * 40


def test_threshold_validation() -> None:
    with pytest.raises(InvalidParameterError) as info:
        OverloadThresholds(yellow_kv_usage=0.99, red_kv_usage=0.9)
    assert info.value.param == "red_kv_usage"
    with pytest.raises(InvalidParameterError):
        OverloadThresholds(red_kv_usage=1.2)
    with pytest.raises(InvalidParameterError):
        OverloadThresholds(exit_ratio=0.0)
    with pytest.raises(InvalidParameterError):
        OverloadThresholds(hold_s=-1.0)
    with pytest.raises(InvalidParameterError):
        OverloadPolicy(shed_retry_after_s=0)


A, D, S = OverloadAction.ADMIT, OverloadAction.DEFER, OverloadAction.SHED
GUA, BUR, BE = Tier.GUARANTEED, Tier.BURSTABLE, Tier.BEST_EFFORT


@pytest.mark.parametrize(
    ("state", "tier", "over_quota", "action"),
    [
        (G, GUA, False, A),
        (G, GUA, True, A),
        (G, BUR, True, A),
        (G, BE, False, A),
        (Y, GUA, False, A),
        (Y, GUA, True, D),
        (Y, BUR, False, A),
        (Y, BUR, True, D),
        (Y, BE, False, D),
        (R, GUA, False, A),
        (R, GUA, True, S),
        (R, BUR, False, A),
        (R, BUR, True, S),
        (R, BE, False, S),
        (R, BE, True, S),
    ],
)
def test_policy_table(state, tier, over_quota, action) -> None:
    decision = OverloadPolicy(shed_retry_after_s=7).admit(state, tier, over_quota)
    assert decision.action is action
    assert decision.retry_after_s == (7 if action is S else None)
    assert decision.admitted == (action is not S)
