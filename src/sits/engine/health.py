"""Engine health: when a silent engine loop counts as hung.

A loop that has sent nothing for a while is either inside one long step or hung. The two differ
in how long they may last: one step (a big prompt chunk on a CPU, a process starved of CPU)
may run for minutes, while between steps the loop turns every fraction of a second, idle or
not. So the engine loop (`EngineLoop`) publishes when the running step started and when it
last turned (`LoopTimes` in a thread, `SharedLoopTimes` across processes), the front end
(`AsyncLLM`) reads them, and `hung_loop_error` applies a bound to each.

Imports nothing heavy: the CLI reads `ENGINE_STEP_TIMEOUT_S` for its flag's default.
"""

from __future__ import annotations

import time
from typing import Any

from sits.core.errors import EngineDeadError

ENGINE_STEP_TIMEOUT_S = 60.0  # as vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S


def hung_loop_error(
    now_s: float,
    turned_s: float,
    step_started_s: float | None,
    health_timeout_s: float,
    step_timeout_s: float,
) -> EngineDeadError | None:
    """Why an engine loop counts as hung, or None while it is live.

    Inside a step the loop is live until the step has run `step_timeout_s`: one long step (a
    big prompt chunk on a CPU, a starved process) is not a hung loop. Between steps it must
    turn within `health_timeout_s` (an idle loop turns every fraction of a second).

    Args:
        now_s, turned_s, step_started_s: time.monotonic() now, when the loop last turned (or
            last reported), and when the running step started (None between steps).
        health_timeout_s, step_timeout_s: the two bounds, seconds.
    """
    if step_started_s is not None:
        if now_s - step_started_s < step_timeout_s:
            return None
        digits = 1 if step_timeout_s >= 1 else 4  # a sub-second timeout: show its scale
        return EngineDeadError(
            f"an engine step has run for {now_s - step_started_s:.{digits}f} s, over the step "
            f"timeout of {step_timeout_s:g} s (--engine-step-timeout)"
        )
    if now_s - turned_s < health_timeout_s:
        return None
    return EngineDeadError(
        f"the engine loop has not turned for {now_s - turned_s:.1f} s between steps "
        f"(health timeout {health_timeout_s:g} s)"
    )


class LoopTimes:
    """The engine loop's times as plain attributes (loop and reader share one process).

    Attributes:
        step_started_s: time.monotonic() start of the running step; 0.0 between steps.
        turned_s: time.monotonic() of the loop's last turn.
    """

    def __init__(self) -> None:
        self.step_started_s = 0.0
        self.turned_s = time.monotonic()

    def mark(self, step_started_s: float) -> None:
        """A turn of the loop now, inside a step started at `step_started_s` (0.0: none)."""
        self.turned_s = time.monotonic()  # before the step mark: never a cleared step with
        self.step_started_s = step_started_s  # a turn older than the step

    def read(self) -> tuple[float, float]:
        """(step_started_s or 0.0, turned_s)."""
        return self.step_started_s, self.turned_s


class SharedLoopTimes:
    """`LoopTimes` over a shared `multiprocessing.Array("d", 2)` (the engine process writes,
    the server process reads): (step start or 0.0, last turn), time.monotonic() seconds, one
    system-wide clock on Linux."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def mark(self, step_started_s: float) -> None:
        """As `LoopTimes.mark`."""
        with self.array.get_lock():
            self.array[:] = (step_started_s, time.monotonic())

    def read(self) -> tuple[float, float]:
        """As `LoopTimes.read` (0.0, 0.0 before the loop's first turn)."""
        with self.array.get_lock():
            step_started_s, turned_s = self.array[:]
        return step_started_s, turned_s
