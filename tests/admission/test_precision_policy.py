"""The precision policy: the exact update at which it switches, on a fake clock."""

from __future__ import annotations

import pytest

from sits.admission import FakeClock, OverloadState
from sits.admission.precision_policy import (
    OverloadPrecisionPolicy,
    PrecisionPolicyKind,
    PrecisionPolicySettings,
    split_precisions,
)
from sits.core.errors import InvalidParameterError

GREEN, YELLOW, RED = OverloadState.GREEN, OverloadState.YELLOW, OverloadState.RED
SETTINGS = PrecisionPolicySettings(PrecisionPolicyKind.OVERLOAD, red_s=5.0, green_s=30.0)


def run(policy: OverloadPrecisionPolicy, clock: FakeClock, trace, current: str) -> list:
    """Feed (time, state) pairs; the engine follows every decision at once. Returns
    [(time, new precision)] of the switches."""
    switches = []
    for now_s, state in trace:
        clock.set(now_s)
        target = policy.decide(state, current)
        if target is not None:
            current = target
            switches.append((now_s, target))
    return switches


def test_low_after_exactly_red_s_of_red_and_back_after_green_s() -> None:
    clock = FakeClock(100.0)
    policy = OverloadPrecisionPolicy(SETTINGS, "bfloat16", "int4", clock)
    red = [(100.0 + 0.25 * i, RED) for i in range(24)]  # 100.00 .. 105.75
    green = [(106.0 + 0.25 * i, GREEN) for i in range(130)]  # 106.00 .. 138.25
    switches = run(policy, clock, red + green, "bfloat16")
    # Red from 100.0: the update at 105.0 is the first at >= 5 s; green from 106.0: 136.0.
    assert switches == [(105.0, "int4"), (136.0, "bfloat16")]


def test_first_update_at_or_after_the_deadline_decides() -> None:
    clock = FakeClock()
    policy = OverloadPrecisionPolicy(SETTINGS, "bfloat16", "fp8", clock)
    trace = [(0.0, RED), (4.999, RED), (7.5, RED)]
    assert run(policy, clock, trace, "bfloat16") == [(7.5, "fp8")]


def test_a_break_restarts_the_stretch() -> None:
    clock = FakeClock()
    policy = OverloadPrecisionPolicy(SETTINGS, "bfloat16", "int4", clock)
    # Red 0-4, yellow at 4.5, red again from 5: low at 10, not at 5.
    trace = [(0.0, RED), (4.0, RED), (4.5, YELLOW), (5.0, RED), (9.9, RED), (10.0, RED)]
    assert run(policy, clock, trace, "bfloat16") == [(10.0, "int4")]
    # Green 10.5-40.4 with a yellow at 40.4: back to full only 30 s after 41.
    trace = [(10.5, GREEN), (40.4, YELLOW), (41.0, GREEN), (70.9, GREEN), (71.0, GREEN)]
    assert run(policy, clock, trace, "int4") == [(71.0, "bfloat16")]


def test_yellow_and_the_matching_precision_never_switch() -> None:
    clock = FakeClock()
    policy = OverloadPrecisionPolicy(SETTINGS, "bfloat16", "int4", clock)
    assert run(policy, clock, [(float(t), YELLOW) for t in range(100)], "bfloat16") == []
    assert run(policy, clock, [(100.0 + t, GREEN) for t in range(60)], "bfloat16") == []
    assert run(policy, clock, [(200.0 + t, RED) for t in range(60)], "int4") == []


def test_operator_switch_restarts_the_count() -> None:
    """Red since 0, low at 5; the operator goes back to full at 8 while red lasts: the policy
    resumes from that choice and switches to low again 5 s later, at 13."""
    clock = FakeClock()
    policy = OverloadPrecisionPolicy(SETTINGS, "bfloat16", "int4", clock)
    assert run(policy, clock, [(0.0, RED), (5.0, RED)], "bfloat16") == [(5.0, "int4")]
    clock.set(8.0)
    policy.restart()  # the operator's switch to bfloat16
    trace = [(8.0, RED), (12.99, RED), (13.0, RED)]
    assert run(policy, clock, trace, "bfloat16") == [(13.0, "int4")]


def test_zero_seconds_switch_at_the_first_update() -> None:
    clock = FakeClock()
    settings = PrecisionPolicySettings(PrecisionPolicyKind.OVERLOAD, red_s=0.0, green_s=0.0)
    policy = OverloadPrecisionPolicy(settings, "bfloat16", "int4", clock)
    trace = [(1.0, RED), (2.0, GREEN)]
    assert run(policy, clock, trace, "bfloat16") == [(1.0, "int4"), (2.0, "bfloat16")]


def test_settings_and_split_validation() -> None:
    assert PrecisionPolicySettings().policy is PrecisionPolicyKind.MANUAL
    assert (PrecisionPolicySettings().red_s, PrecisionPolicySettings().green_s) == (5.0, 30.0)
    with pytest.raises(InvalidParameterError) as err:
        PrecisionPolicySettings(red_s=-1.0)
    assert err.value.param == "precision_red_seconds"
    with pytest.raises(InvalidParameterError) as err:
        PrecisionPolicySettings(green_s=float("inf"))
    assert err.value.param == "precision_green_seconds"
    assert split_precisions(("bfloat16", "int4")) == ("bfloat16", "int4")
    assert split_precisions(("fp8", "float32")) == ("float32", "fp8")
    for bad in (("bfloat16",), ("fp8", "int4"), ("a", "b")):
        with pytest.raises(InvalidParameterError):
            split_precisions(bad)
