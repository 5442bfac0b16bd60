"""GC pause timing (gc.callbacks) and freezing the startup heap (sits.obs.gc_pauses)."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from sits.obs.gc_pauses import GcPauseMonitor, IdleFullCollections
from sits.obs.loop_lag import EventLoopLagMonitor


def test_record_observes_and_warns_once_per_period(caplog) -> None:
    seen: list[tuple[int, float]] = []
    monitor = GcPauseMonitor(lambda g, s: seen.append((g, s)), warn_pause_s=0.05,
                             warn_every_s=10, where="engine")  # fmt: skip
    with caplog.at_level("WARNING", logger="sits.obs.gc_pauses"):
        monitor.record(2, 0.2, now_s=100.0)  # warns
        monitor.record(0, 0.001, now_s=101.0)  # short: silent
        monitor.record(2, 0.4, now_s=105.0)  # within 10 s of the last warning: silent
        monitor.record(1, 0.3, now_s=110.0)  # warns
    assert seen == [(2, 0.2), (0, 0.001), (2, 0.4), (1, 0.3)]
    assert monitor.num_collections == 4 and monitor.max_pause_s == 0.4
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert warnings[0].startswith("engine: garbage collection of generation 2 paused every")
    assert "generation 1" in warnings[1] and "0.300 s" in warnings[1]


def test_hook_times_each_real_collection_and_close_removes_it() -> None:
    ticks = iter(range(100))
    seen: list[tuple[int, float]] = []
    monitor = GcPauseMonitor(lambda g, s: seen.append((g, s)), clock=lambda: next(ticks))
    gc.disable()  # no automatic collection between the explicit ones
    try:
        monitor.install().install()  # twice: one hook
        gc.collect(1)
        gc.collect()
        monitor.close()
        gc.collect()
    finally:
        gc.enable()
    assert seen == [(1, 1.0), (2, 1.0)]  # fake clock: one tick from start to stop


def test_observer_errors_never_reach_the_collector(caplog) -> None:
    def broken(generation: int, pause_s: float) -> None:
        raise RuntimeError("observer bug")

    monitor = GcPauseMonitor(broken).install()
    try:
        with caplog.at_level("ERROR", logger="sits.obs.gc_pauses"):
            gc.collect()
    finally:
        monitor.close()
    assert monitor.num_collections == 1
    assert "gc pause observer failed" in caplog.text


_FREEZE_PROBE = """
import gc, json
from sits.obs.gc_pauses import freeze_startup_heap
frozen = freeze_startup_heap()
counts = [frozen, gc.get_freeze_count(), gc.get_count()[0]]
gc.unfreeze()
print(json.dumps(counts + [gc.get_freeze_count()]))
"""


def test_freeze_moves_survivors_out_of_collections() -> None:
    """In a fresh interpreter: freezing is process-wide, and a live test server in this process
    freezes and unfreezes its own heap (`uvicorn_server`) whenever it starts or stops."""
    probe = subprocess.run(
        [sys.executable, "-c", _FREEZE_PROBE], capture_output=True, text=True, check=True
    )
    frozen, count, gen0, after = json.loads(probe.stdout.strip().splitlines()[-1])
    assert frozen == count > 1000  # the interpreter's and sits's modules at least
    assert gen0 < 100  # the collection before freezing emptied generation 0
    assert after == 0


def test_loop_lag_monitor_exports_gc_pauses_while_running() -> None:
    registry = CollectorRegistry()
    monitor = EventLoopLagMonitor(registry, "m", interval_s=0.01)

    async def main() -> None:
        monitor.start()
        gc.collect()
        await monitor.stop()
        gc.collect()  # after stop: not counted

    gc.disable()  # only the explicit collections
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    labels = {"model_name": "m", "generation": "2"}
    assert registry.get_sample_value("sits:gc_pause_seconds_count", labels) == pytest.approx(1)
    assert monitor.gc_pauses.num_collections == 1


def test_full_collections_wait_for_idle_moments_or_the_longest_gap() -> None:
    now = [0.0]
    before = gc.get_threshold()
    full = IdleFullCollections(min_idle_interval_s=5, max_interval_s=60, clock=lambda: now[0])
    gc.disable()  # only the collections this test runs
    try:
        full.install().install()
        assert gc.get_threshold() == (before[0], before[1], IdleFullCollections.NEVER)
        gc.collect(1)  # a younger collection: something was promoted
        now[0] = 3.0
        assert not full.tick(idle=True)  # idle, but within 5 s of the last
        now[0] = 6.0
        assert not full.tick(idle=False)  # busy
        assert full.tick(idle=True)  # idle and due
        assert gc.get_count()[2] == 0  # it was a full collection
        now[0] = 20.0
        assert not full.tick(idle=True)  # nothing promoted since
        now[0] = 30.0
        gc.collect(1)
        now[0] = 65.0
        assert not full.tick(idle=False)  # 59 s under load
        now[0] = 66.0
        assert full.tick(idle=False)  # 60 s: runs under load too
        assert full.num_full_collections == 2
    finally:
        full.close()
        gc.enable()
    assert gc.get_threshold() == before
