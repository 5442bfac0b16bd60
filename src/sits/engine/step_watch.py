"""How long an engine step may run before `/health` reports it stalled.

The hard bound (`--engine-step-timeout`, 60 s by default) ends the engine; it must be long,
because one legitimate step can be long (a big prompt chunk on a CPU, a machine under heavy
contention: CPU runs have seen 15-20 s steps). A frozen engine (SIGSTOP, a driver hang)
therefore kept `/health` at 200 for a minute while new requests hung. The stall limit judges
the running step by what this engine's steps cost instead, and `/health` answers 503 with
the reason once a step has run past it (`sits.engine.async_llm.AsyncLLM.stall_reason`),
while the engine lives on: a load balancer stops sending work at once, and the step that
finishes after all turns `/health` back to 200.

Rule (`stall_limit_s`): limit = max(floor, STALL_FACTOR x typical), capped at the hard
timeout, where typical (`StepWatch.typical_s`, measured by the engine loop) is the largest of
the p99 of the last `STALL_WINDOW_STEPS` steps' wall times and the warm-up's full-budget
prefill step (`runner.warmup.WarmupReport`: the costliest step shape, timed before any
traffic). The floor (`--engine-stall-floor`; 5 s on a GPU, 30 s on a CPU by default) keeps a
busy CPU's long steps from reporting a stall: a step judged stalled has run at least 10 times
this engine's slow steps and at least the floor.

Invariants: the engine loop records every step's wall time (`StepWatch.record`) and publishes
`typical_s` with each step's start (`engine_loop.LoopTimes.mark`); nothing here reads a clock.
"""

from __future__ import annotations

from collections import deque

STALL_FACTOR = 10.0  # a stalled step has run this many times the engine's slow (p99) steps
STALL_FLOOR_S = {"cuda": 5.0, "cpu": 30.0}  # default floors by device type, seconds
STALL_WINDOW_STEPS = 256
STALL_RESORT_STEPS = 32  # steps between two sorts of the window (the p99's fall)


class StepWatch:
    """The engine loop's recent step wall times (seconds) and their slow end.

    Args:
        seed_s: the warm-up's full-budget step, seconds, or None (no warm-up ran).
        window: steps kept for the p99.
    """

    def __init__(self, seed_s: float | None = None, window: int = STALL_WINDOW_STEPS) -> None:
        self.seed_s = seed_s or 0.0
        self._steps: deque[float] = deque(maxlen=window)
        self._typical_s = self.seed_s
        self._since_sort = 0

    def record(self, step_s: float) -> None:
        """A step ran `step_s` wall seconds. On the engine's per-step path, so O(1) but every
        `STALL_RESORT_STEPS`-th call: a step slower than the typical one raises it at once,
        and the p99 of the window (which may lower it) is re-sorted only then."""
        self._steps.append(step_s)
        self._since_sort += 1
        if step_s > self._typical_s:
            self._typical_s = step_s
        if self._since_sort >= STALL_RESORT_STEPS:
            self._since_sort = 0
            ordered = sorted(self._steps)
            p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            self._typical_s = max(p99, self.seed_s)

    def typical_s(self) -> float:
        """max(p99 of the window, the seed), seconds, as of the last sort, raised since by any
        slower step; 0.0 before any step or seed."""
        return self._typical_s


def stall_limit_s(typical_s: float, floor_s: float, timeout_s: float) -> float:
    """Seconds a step may run before it counts as stalled (the module's rule)."""
    return min(timeout_s, max(floor_s, STALL_FACTOR * typical_s))


def stall_reason(elapsed_s: float, typical_s: float, limit_s: float) -> str:
    """The reason `/health` gives for a stalled step."""
    return (
        f"an engine step has run for {elapsed_s:.1f} s, past its stall limit of {limit_s:.1f} s "
        f"({STALL_FACTOR:g}x this engine's slow steps of {typical_s:.3f} s, at least "
        f"--engine-stall-floor)"
    )
