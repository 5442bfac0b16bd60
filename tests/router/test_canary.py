"""Canary rollout: steps 5 -> 25 -> 50 -> 100 %, rollback, config checks, with a fake clock."""

from __future__ import annotations

import pytest

from sits.admission import FakeClock
from sits.core.errors import InvalidParameterError
from sits.router.canary import (
    CanaryConfig,
    CanaryController,
    CanaryDecision,
    CanaryState,
    SideStats,
    pick_canary,
)

CONFIG = CanaryConfig(min_samples=4, step_hold_s=10.0, window_s=60.0)


def _controller(config: CanaryConfig = CONFIG) -> tuple[CanaryController, FakeClock]:
    clock = FakeClock()
    return CanaryController(config, clock), clock


def _feed(
    ctl: CanaryController,
    n: int,
    canary_ttft_s: float = 0.1,
    stable_ttft_s: float = 0.1,
    tpot_s: float = 0.02,
    canary_failed: int = 0,
    stable_failed: int = 0,
) -> None:
    """n requests on each side; the first *_failed of each side failed (no latency)."""
    for i in range(n):
        c_fail, s_fail = i < canary_failed, i < stable_failed
        ctl.record(True, None if c_fail else canary_ttft_s, None if c_fail else tpot_s, c_fail)
        ctl.record(False, None if s_fail else stable_ttft_s, None if s_fail else tpot_s, s_fail)


def test_inactive_until_a_canary_is_present() -> None:
    ctl, _ = _controller()
    assert (ctl.state, ctl.weight, ctl.history) == (CanaryState.INACTIVE, 0.0, [])
    assert ctl.evaluate(canary_present=False) is None
    start = ctl.evaluate(canary_present=True)
    assert start == CanaryDecision(
        0.0, 0.0, 0.05, CanaryState.RAMPING, "canary replica present: start at 5 %"
    )
    assert (ctl.state, ctl.weight) == (CanaryState.RAMPING, 0.05)
    assert ctl.evaluate(canary_present=True) is None  # no evidence yet


def test_steps_5_25_50_100_then_promoted() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    weights = []
    for step in range(3):
        _feed(ctl, 4)
        clock.set(10.0 * step + 9.5)
        assert ctl.evaluate(True) is None  # enough samples, hold not over
        clock.set(10.0 * (step + 1))
        decision = ctl.evaluate(True)
        assert decision is not None
        weights.append((decision.from_weight, decision.to_weight, decision.time_s))
        assert ctl.evaluate(True) is None  # windows start over after each step
    assert weights == [(0.05, 0.25, 10.0), (0.25, 0.5, 20.0), (0.5, 1.0, 30.0)]
    assert (ctl.state, ctl.weight) == (CanaryState.PROMOTED, 1.0)
    assert [d.state for d in ctl.history] == [CanaryState.RAMPING] * 3 + [CanaryState.PROMOTED]
    assert ctl.history[1].reason == (
        "within bounds over 4 canary / 4 stable requests (ttft p95 0.100 s vs 0.100 s, "
        "tpot p95 0.020 s vs 0.020 s, errors 0.000 vs 0.000): 5 % -> 25 %"
    )
    _feed(ctl, 4, canary_ttft_s=9.0)
    clock.set(100.0)
    assert ctl.evaluate(True) is None  # promoted stays until reset
    assert ctl.evaluate(False) is None


def test_no_step_without_min_samples_on_both_sides() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    for _ in range(10):
        ctl.record(True, 0.1, 0.02, False)
    for _ in range(3):
        ctl.record(False, 0.1, 0.02, False)
    clock.set(50.0)
    assert ctl.evaluate(True) is None
    ctl.record(False, 0.1, 0.02, False)
    assert ctl.evaluate(True).to_weight == 0.25


def test_samples_older_than_the_window_do_not_count() -> None:
    ctl, clock = _controller(CanaryConfig(min_samples=4, step_hold_s=10.0, window_s=20.0))
    ctl.evaluate(True)
    _feed(ctl, 4)
    clock.set(20.0)  # they are exactly window_s old: gone
    assert ctl.evaluate(True) is None
    assert ctl.side_stats(is_canary=True) == SideStats(0, None, None, None)


def test_ttft_bound_rolls_back_at_once() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    clock.set(1.0)  # well inside the hold: a rollback does not wait
    _feed(ctl, 4, canary_ttft_s=0.4, stable_ttft_s=0.2)  # 0.4 > 0.2 * 1.5 + 0.05
    decision = ctl.evaluate(True)
    assert decision == CanaryDecision(
        1.0,
        0.05,
        0.0,
        CanaryState.ROLLED_BACK,
        "rollback: canary ttft p95 0.400 s > 1.5 x stable 0.200 s + 0.050 s",
    )
    assert (ctl.state, ctl.weight) == (CanaryState.ROLLED_BACK, 0.0)
    _feed(ctl, 4)
    clock.set(100.0)
    assert ctl.evaluate(True) is None  # stays rolled back


def test_latency_exactly_at_the_bound_is_within() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    _feed(ctl, 4, canary_ttft_s=0.35, stable_ttft_s=0.2)  # 0.35 == 0.2 * 1.5 + 0.05
    clock.set(10.0)
    assert ctl.evaluate(True).to_weight == 0.25


def test_slack_keeps_tiny_latencies_from_flapping() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    _feed(ctl, 4, canary_ttft_s=0.04, stable_ttft_s=0.001)  # 40x slower, within 50 ms slack
    clock.set(10.0)
    assert ctl.evaluate(True).to_weight == 0.25


def test_tpot_and_error_bounds() -> None:
    ctl, _ = _controller()
    ctl.evaluate(True)
    for _ in range(4):
        ctl.record(True, 0.1, 0.2, False)
        ctl.record(False, 0.1, 0.02, False)
    assert ctl.evaluate(True).reason == (
        "rollback: canary tpot p95 0.200 s > 1.5 x stable 0.020 s + 0.050 s"
    )
    ctl.reset()
    ctl.evaluate(True)
    _feed(ctl, 4, canary_failed=1)  # 25 % failed against 0 %
    assert ctl.evaluate(True).reason == "rollback: canary error rate 0.250 > stable 0.000 + 0.050"


def test_error_rate_within_the_delta_steps_up() -> None:
    ctl, clock = _controller(
        CanaryConfig(min_samples=4, step_hold_s=0.0, max_error_rate_delta=0.25)
    )
    ctl.evaluate(True)
    _feed(ctl, 4, canary_failed=2, stable_failed=1)  # 0.5 - 0.25 = 0.25: not over
    assert ctl.evaluate(True).to_weight == 0.25
    assert clock.monotonic() == 0.0  # step_hold_s 0: steps as soon as the evidence is there


def test_several_broken_bounds_in_one_reason() -> None:
    ctl, _ = _controller()
    ctl.evaluate(True)
    for _ in range(4):
        ctl.record(True, 1.0, 1.0, False)
        ctl.record(False, 0.1, 0.01, False)
    assert ctl.evaluate(True).reason == (
        "rollback: canary ttft p95 1.000 s > 1.5 x stable 0.100 s + 0.050 s; "
        "canary tpot p95 1.000 s > 1.5 x stable 0.010 s + 0.050 s"
    )


def test_all_canary_requests_failed_rolls_back_by_error_rate() -> None:
    ctl, _ = _controller()
    ctl.evaluate(True)
    _feed(ctl, 4, canary_failed=4)
    decision = ctl.evaluate(True)
    assert decision.reason == "rollback: canary error rate 1.000 > stable 0.000 + 0.050"


def test_canary_gone_and_back_then_reset_after_rollback() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    clock.set(3.0)
    gone = ctl.evaluate(False)
    assert (gone.to_weight, gone.state, gone.reason) == (
        0.0,
        CanaryState.INACTIVE,
        "no canary replica left",
    )
    assert ctl.evaluate(True).to_weight == 0.05
    _feed(ctl, 4, canary_failed=4)
    ctl.evaluate(True)
    assert ctl.state is CanaryState.ROLLED_BACK
    ctl.reset()
    assert (ctl.state, ctl.weight) == (CanaryState.INACTIVE, 0.0)
    assert ctl.side_stats(True).count == 0
    assert ctl.evaluate(True).to_weight == 0.05  # a new canary starts over
    assert len(ctl.history) == 5


def test_initial_weight_between_steps() -> None:
    ctl, clock = _controller(CanaryConfig(initial_weight=0.1, min_samples=1, step_hold_s=1.0))
    assert ctl.evaluate(True).reason == "canary replica present: start at 10 %"
    _feed(ctl, 1)
    clock.set(1.0)
    assert ctl.evaluate(True).to_weight == 0.25


def test_snapshot() -> None:
    ctl, clock = _controller()
    ctl.evaluate(True)
    ctl.record(True, 0.3, None, False)
    ctl.record(False, None, None, True)
    snap = ctl.snapshot()
    assert snap["state"] == "ramping"
    assert snap["weight"] == 0.05
    assert snap["config"]["steps"] == [0.05, 0.25, 0.5, 1.0]
    assert snap["config"]["min_samples"] == 4
    assert snap["windows"] == {
        "canary": {"count": 1, "ttft_p95_s": 0.3, "tpot_p95_s": None, "error_rate": 0.0},
        "stable": {"count": 1, "ttft_p95_s": None, "tpot_p95_s": None, "error_rate": 1.0},
    }
    assert snap["history"] == [
        {
            "time_s": 0.0,
            "from_weight": 0.0,
            "to_weight": 0.05,
            "state": "ramping",
            "reason": "canary replica present: start at 5 %",
            "age_s": 0.0,
        }
    ]


def test_record_rejects_negative_latency() -> None:
    ctl, _ = _controller()
    with pytest.raises(InvalidParameterError):
        ctl.record(True, -1.0, None, False)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"initial_weight": 0.0}, "initial_weight"),
        ({"initial_weight": 1.5}, "initial_weight"),
        ({"steps": ()}, "steps"),
        ({"steps": (0.25, 0.5)}, "steps"),
        ({"steps": (0.5, 0.25, 1.0)}, "steps"),
        ({"steps": (0.0, 1.0)}, "steps"),
        ({"window_s": 0.0}, "window_s"),
        ({"min_samples": 0}, "min_samples"),
        ({"step_hold_s": -1.0}, "step_hold_s"),
        ({"max_ttft_p95_ratio": 0.9}, "max_ttft_p95_ratio"),
        ({"max_tpot_p95_ratio": 0.5}, "max_tpot_p95_ratio"),
        ({"latency_slack_s": -0.01}, "latency_slack_s"),
        ({"max_error_rate_delta": 1.5}, "max_error_rate_delta"),
    ],
)
def test_invalid_configs(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        CanaryConfig(**kwargs)
    assert err.value.param == param


def test_steps_given_as_a_list_become_a_tuple() -> None:
    assert CanaryConfig(steps=[0.5, 1.0]).steps == (0.5, 1.0)


def test_pick_canary() -> None:
    assert [pick_canary(0.25, u) for u in (0.0, 0.2499, 0.25, 0.9)] == [True, True, False, False]
    assert pick_canary(0.0, 0.0) is False
    assert pick_canary(1.0, 0.999) is True
    for weight, u, param in ((1.5, 0.5, "weight"), (0.5, 1.0, "u"), (0.5, -0.1, "u")):
        with pytest.raises(InvalidParameterError) as err:
            pick_canary(weight, u)
        assert err.value.param == param
