"""Latency windows, the P99 TTFT predictor and the fallback rule, exactly with a fake clock."""

from __future__ import annotations

import math

import pytest

from sits.admission import FakeClock
from sits.core.errors import InvalidParameterError
from sits.core.fleet import ReplicaLoad
from sits.router.predictor import LatencyWindow, fallback_needed, predict_ttft_p99_s


def _window(values: list[float], clock: FakeClock | None = None) -> LatencyWindow:
    window = LatencyWindow(clock or FakeClock())
    for value in values:
        window.add(value)
    return window


def test_nearest_rank_percentiles() -> None:
    window = _window([float(v) for v in range(100, 0, -1)])  # 1..100, added in reverse
    assert window.count() == 100
    assert window.percentile(50) == 50.0
    assert window.percentile(95) == 95.0
    assert window.percentile(99) == 99.0
    assert window.percentile(100) == 100.0
    assert window.percentile(0.5) == 1.0
    small = _window([0.3, 0.1, 0.2])
    assert small.percentile(50) == 0.2  # rank ceil(1.5) = 2
    assert small.percentile(99) == 0.3
    assert small.percentile(33) == 0.1  # rank ceil(0.99) = 1
    assert small.mean() == pytest.approx(0.2)


def test_empty_window() -> None:
    window = LatencyWindow(FakeClock())
    assert window.count() == 0
    assert window.percentile(99) is None
    assert window.mean() is None
    assert window.values() == []


def test_samples_leave_at_exactly_window_s() -> None:
    clock = FakeClock()
    window = LatencyWindow(clock, window_s=10.0)
    window.add(1.0)
    clock.set(5.0)
    window.add(2.0)
    clock.set(9.75)
    assert window.values() == [1.0, 2.0]
    clock.set(10.0)  # the first sample is now exactly 10 s old
    assert window.values() == [2.0]
    assert window.percentile(99) == 2.0
    clock.set(15.0)
    assert window.count() == 0


def test_max_samples_keeps_the_newest() -> None:
    window = LatencyWindow(FakeClock(), max_samples=3)
    for value in (1.0, 2.0, 3.0, 4.0):
        window.add(value)
    assert window.values() == [2.0, 3.0, 4.0]
    window.clear()
    assert window.count() == 0


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"window_s": 0.0}, "window_s"), ({"max_samples": 0}, "max_samples")],
)
def test_invalid_window(kwargs: dict[str, float], param: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        LatencyWindow(FakeClock(), **kwargs)
    assert err.value.param == param


@pytest.mark.parametrize("value", [-0.1, math.inf, math.nan])
def test_invalid_sample(value: float) -> None:
    with pytest.raises(InvalidParameterError) as err:
        LatencyWindow(FakeClock()).add(value)
    assert err.value.param == "value_s"


@pytest.mark.parametrize("q", [0.0, -1.0, 100.5])
def test_invalid_percentile(q: float) -> None:
    with pytest.raises(InvalidParameterError) as err:
        _window([1.0]).percentile(q)
    assert err.value.param == "q"


def test_prediction_prefers_router_observations_with_enough_samples() -> None:
    load = ReplicaLoad(num_running=4, num_waiting=2, ttft_p99_s=0.9)
    observed = _window([0.1, 0.2, 0.3, 0.4])
    # 4 samples < min_samples 5: the heartbeat's p99 0.9 s, x (1 + 2 / 4)
    assert predict_ttft_p99_s(observed, load, inflight=0) == pytest.approx(1.35)
    observed.add(0.5)
    # 5 samples: p99 = 0.5 s, x (1 + 2 / (4 + 4))
    assert predict_ttft_p99_s(observed, load, inflight=4) == pytest.approx(0.625)
    assert predict_ttft_p99_s(observed, load, inflight=0, min_samples=6) == pytest.approx(1.35)


def test_prediction_without_heartbeat_figures_uses_few_observations() -> None:
    load = ReplicaLoad(num_waiting=3)  # a static replica: no heartbeat latency
    assert predict_ttft_p99_s(_window([0.2]), load, inflight=0) == pytest.approx(0.8)  # x (1+3/1)
    assert predict_ttft_p99_s(_window([]), load, inflight=5) is None
    assert predict_ttft_p99_s(_window([]), ReplicaLoad(ttft_p99_s=0.25), 0) == 0.25  # idle


def test_prediction_rejects_bad_arguments() -> None:
    with pytest.raises(InvalidParameterError) as err:
        predict_ttft_p99_s(_window([]), ReplicaLoad(), inflight=-1)
    assert err.value.param == "inflight"
    with pytest.raises(InvalidParameterError) as err:
        predict_ttft_p99_s(_window([]), ReplicaLoad(), inflight=0, min_samples=0)
    assert err.value.param == "min_samples"


def test_fallback_needed_only_when_every_prediction_is_over() -> None:
    assert fallback_needed([0.9, 1.2], limit_s=0.8) is True
    assert fallback_needed([0.9, 0.8], limit_s=0.8) is False  # 0.8 is not over 0.8
    assert fallback_needed([0.9, None], limit_s=0.8) is False  # unknown counts as under
    assert fallback_needed([None], limit_s=0.8) is False
    assert fallback_needed([], limit_s=0.8) is True  # no primary candidate at all
    with pytest.raises(InvalidParameterError) as err:
        fallback_needed([1.0], limit_s=0.0)
    assert err.value.param == "limit_s"
