"""The event-loop lag monitor and the GIL switch-interval knob of `sits serve`."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from prometheus_client import CollectorRegistry

from sits.core.errors import InvalidParameterError
from sits.obs.loop_lag import EventLoopLagMonitor, apply_switch_interval
from tests.server.test_cli import _parse


def _sample(registry: CollectorRegistry, suffix: str) -> float:
    value = registry.get_sample_value(f"sits:event_loop_lag_seconds_{suffix}", {"model_name": "m"})
    assert value is not None
    return value


def test_record_counts_clamps_and_warns_once_per_period(caplog) -> None:
    registry = CollectorRegistry()
    monitor = EventLoopLagMonitor(registry, "m", interval_s=0.01, warn_lag_s=0.2, warn_every_s=10)
    with caplog.at_level("WARNING", logger="sits.obs.loop_lag"):
        monitor.record(-0.001, now_s=100.0)  # early wake-up: 0
        monitor.record(0.3, now_s=101.0)  # warns
        monitor.record(0.5, now_s=105.0)  # within 10 s of the last warning: silent
        monitor.record(0.05, now_s=120.0)  # under the threshold: silent
        monitor.record(0.4, now_s=111.0)  # 10 s after the first warning: warns
    assert monitor.num_samples == 5 and monitor.max_lag_s == 0.5
    assert _sample(registry, "count") == 5
    assert _sample(registry, "sum") == pytest.approx(0.3 + 0.5 + 0.05 + 0.4)
    warnings = [r for r in caplog.records if "event loop lag" in r.getMessage()]
    assert [r.getMessage().split()[3] for r in warnings] == ["0.300", "0.400"]


def test_a_blocked_loop_shows_as_lag() -> None:
    registry = CollectorRegistry()
    monitor = EventLoopLagMonitor(registry, "m", interval_s=0.01)

    async def main() -> None:
        monitor.start()
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # block the loop: the due timer wakes >= 0.29 s late
        await asyncio.sleep(0.05)
        await monitor.stop()

    asyncio.run(main())
    assert monitor.max_lag_s >= 0.29
    assert _sample(registry, "count") == monitor.num_samples >= 2


def test_switch_interval_flag_and_validation() -> None:
    before = sys.getswitchinterval()
    try:
        assert _parse([]).gil_switch_interval_ms == 0.2
        assert _parse(["--gil-switch-interval-ms", "1.5"]).gil_switch_interval_ms == 1.5
        previous_ms = apply_switch_interval(0.5)
        assert previous_ms == pytest.approx(before * 1e3)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        for bad in (0.0, -1.0, float("nan"), float("inf"), 1000.5):
            with pytest.raises(InvalidParameterError) as info:
                apply_switch_interval(bad)
            assert info.value.param == "gil_switch_interval_ms"
            assert "--gil-switch-interval-ms" in str(info.value)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
