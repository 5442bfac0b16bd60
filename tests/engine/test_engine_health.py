"""Engine health: a long step is not a hung loop; the front end reads the loop's times, which
the engine loop publishes (shared across processes in the engine process mode)."""

from __future__ import annotations

import multiprocessing
import types

from sits.engine import engine_loop
from sits.engine.async_llm import AsyncLLM
from sits.engine.engine_loop import LoopTimes, SharedLoopTimes, hung_loop_error
from sits.engine.step_watch import StepWatch, stall_limit_s


def test_hung_loop_error_bounds_a_step_and_the_time_between_steps() -> None:
    # Between steps: the loop must turn within the health timeout (10 s).
    assert hung_loop_error(100.0, 90.5, None, 10.0, 60.0) is None
    error = hung_loop_error(100.0, 90.0, None, 10.0, 60.0)
    assert "has not turned for 10.0 s between steps (health timeout 10 s)" in str(error)
    # Inside a step: the step's own start counts, up to the step timeout (60 s).
    assert hung_loop_error(100.0, 0.0, 40.5, 10.0, 60.0) is None  # 59.5 s into one step
    error = hung_loop_error(100.0, 99.0, 40.0, 10.0, 60.0)
    assert "has run for 60.0 s, over the step timeout of 60 s (--engine-step-timeout)" in str(error)


def _parent(loop_times, heartbeat_s: float) -> AsyncLLM:
    """An AsyncLLM's health side alone (no engine), its transport alive."""
    engine = object.__new__(AsyncLLM)
    engine.errored = engine._stopping = False
    engine.dead_error = None
    engine.health_timeout_s, engine.step_timeout_s, engine.stall_floor_s = 1.0, 30.0, 2.0
    engine._heartbeat_s = heartbeat_s
    engine.transport = types.SimpleNamespace(
        alive=lambda: True, loop_times=SharedLoopTimes(loop_times)
    )
    return engine


def test_engine_process_health_reads_the_childs_loop_times(monkeypatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("sits.engine.async_llm.time.monotonic", lambda: clock[0])
    times = multiprocessing.get_context("spawn").Array("d", 3)
    engine = _parent(times, heartbeat_s=990.0)  # nothing received for 10 s...
    times[:] = (995.0, 995.0, 1.0)  # ...but the child is 5 s into one step
    assert engine.is_healthy()
    times[:] = (0.0, 999.5, 1.0)  # between steps, its loop turned 0.5 s ago
    assert engine.is_healthy()
    times[:] = (0.0, 998.0, 1.0)  # between steps and silent for 2 s: hung
    assert not engine.is_healthy()
    assert "between steps" in str(engine.dead_error)
    engine = _parent(times, heartbeat_s=999.9)  # a message just arrived: it counts as a turn
    assert engine.is_healthy()
    times[:] = (969.0, 999.0, 1.0)  # a step of 31 s
    assert not engine.is_healthy()
    assert "over the step timeout of 30 s" in str(engine.dead_error)


def test_engine_loop_publishes_its_step_and_turn_times(monkeypatch) -> None:
    clock = [50.0]
    monkeypatch.setattr(engine_loop.time, "monotonic", lambda: clock[0])
    times = multiprocessing.get_context("spawn").Array("d", 3)
    thread_times = LoopTimes()
    seen: list[tuple[float, float]] = []

    class Core:
        scheduler = type("Sched", (), {"num_running": 0, "num_waiting": 0})()
        pending = 1

        def has_unfinished_requests(self) -> bool:
            return self.pending > 0

    class Driver:
        stats = type("Stats", (), {"num_running": 0, "num_waiting": 0})()

        def step(self, while_gpu_runs=None) -> tuple[list, bool]:
            seen.append(tuple(times[:]))  # what the parent sees during the step
            seen.append(thread_times.read())  # ... and a front end in the same process
            clock[0] += 7.0  # a 7 s step
            proc.core.pending = 0
            proc.stopping = True
            return [], False

    proc = object.__new__(engine_loop.EngineLoop)
    proc.core, proc.driver, proc.stopping = Core(), Driver(), False
    shared = SharedLoopTimes(times)

    class BothTimes:
        def mark(self, step_started_s: float, typical_step_s: float = 0.0) -> None:
            shared.mark(step_started_s, typical_step_s)
            thread_times.mark(step_started_s, typical_step_s)

    proc.loop_times = BothTimes()
    proc.pending = None
    proc.stats_time_s = 0.0
    proc.step_watch = StepWatch(seed_s=0.5)  # the warm-up's full step: 0.5 s
    proc.drain = lambda block: None
    proc.snapshot = lambda force: None
    proc.profile = type(
        "Profile", (), {"mark": lambda s: None, "lap": lambda s, n: None, "maybe_log": lambda s: 0}
    )()
    assert proc.run() is False  # stopped, not died
    # inside the step: its start, the loop's turn and the typical step so far (the seed)
    assert seen == [(50.0, 50.0, 0.5)] * 2
    # after it: no step, its end, and the 7 s step is now the slow one
    assert times[:] == [0.0, 57.0, 7.0] and thread_times.read() == (0.0, 57.0, 7.0)


def test_a_sub_second_step_timeout_shows_the_step_at_its_scale() -> None:
    error = hung_loop_error(100.0, 99.0, 99.9985, 10.0, 0.001)
    assert "has run for 0.0015 s, over the step timeout of 0.001 s" in str(error)


def test_the_stall_limit_is_ten_slow_steps_within_the_floor_and_the_timeout() -> None:
    watch = StepWatch(seed_s=0.2)  # the warm-up's full-budget step
    assert watch.typical_s() == 0.2
    for _ in range(99):
        watch.record(0.01)
    watch.record(0.9)  # one slow step in 100: the p99
    assert watch.typical_s() == 0.9
    assert stall_limit_s(0.9, 5.0, 60.0) == 9.0  # 10 x 0.9 s
    assert stall_limit_s(0.01, 5.0, 60.0) == 5.0  # the floor (a GPU's default)
    assert stall_limit_s(20.0, 30.0, 60.0) == 60.0  # never past the hard timeout
    assert StepWatch().typical_s() == 0.0


def test_a_frozen_step_is_reported_stalled_long_before_the_hard_timeout(monkeypatch) -> None:
    """The trial: a SIGSTOPped engine kept /health at 200 for the 60 s step timeout. With
    steps of 0.1 s and a 2 s floor, a step frozen for 2.5 s is stalled (the engine still
    counts as alive: the hard timeout decides that), and it clears when the step ends."""
    clock = [1000.0]
    monkeypatch.setattr("sits.engine.async_llm.time.monotonic", lambda: clock[0])
    times = multiprocessing.get_context("spawn").Array("d", 3)
    engine = _parent(times, heartbeat_s=999.0)
    times[:] = (999.0, 999.0, 0.1)  # 1 s into a step; slow steps take 0.1 s
    assert engine.stall_reason() is None and engine.is_healthy()
    clock[0] = 1001.5  # 2.5 s into it: past max(2 s floor, 10 x 0.1 s)
    reason = engine.stall_reason()
    assert reason is not None and "run for 2.5 s, past its stall limit of 2.0 s" in reason
    assert engine.is_healthy() and engine.dead_error is None  # alive: 2.5 s < 30 s
    times[:] = (0.0, 1001.5, 0.1)  # the step ended
    assert engine.stall_reason() is None
