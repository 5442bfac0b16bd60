"""Records what each engine step computed, for the offline benchmarks' rooflines.

`StepRecorder.attach(core)` wraps the engine core's `runner.run` on that one object (the
benchmark's own engine, never shared), so each `StepPlan` the scheduler made is summarised as a
`StepShape` (tokens, sequences, sampled rows, keys read, attention pairs) before it runs; the
runner's behaviour and results are unchanged. Step durations are taken by the benchmarks
around `EngineCore.step()` (latency) or over the whole run (throughput).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sits.bench.roofline import StepShape, step_shape
from sits.core.plan import StepPlan
from sits.engine.stats import CORE_PHASES, RUNNER_PHASES


def shape_of_plan(plan: StepPlan) -> StepShape:
    """The StepShape of a plan: its chunks and the requests that sample this step."""
    return step_shape(
        ((sr.start_position, sr.num_tokens) for sr in plan.scheduled),
        num_sampled=sum(1 for sr in plan.scheduled if sr.sample),
    )


class StepRecorder:
    """Collects the StepShape of every non-empty step an engine core runs.

    Attributes:
        shapes: one StepShape per non-empty step, in order.
    """

    def __init__(self) -> None:
        self.shapes: list[StepShape] = []

    def attach(self, core: Any) -> StepRecorder:
        """Wrap `core.runner.run` and `core.runner.collect` (an `EngineCore`) so that every
        plan is recorded when its step is run (synchronous) or its tokens are collected (async
        scheduling: one step per `EngineCore.step`, as when synchronous); returns self."""
        runner = core.runner
        run: Callable[..., Any] = runner.run
        collect: Callable[..., Any] = runner.collect

        def recording_run(plan: StepPlan, *args: Any) -> Any:
            if plan.scheduled:
                self.shapes.append(shape_of_plan(plan))
            return run(plan, *args)

        def recording_collect(launched: Any) -> Any:
            self.shapes.append(shape_of_plan(launched.plan))
            return collect(launched)

        runner.run = recording_run
        runner.collect = recording_collect
        return self

    def take(self) -> list[StepShape]:
        """The shapes recorded since the last take (and forget them)."""
        shapes, self.shapes = self.shapes, []
        return shapes


def phase_counters(core: Any) -> dict[str, float]:
    """The engine core's cumulative phase seconds (schedule, runner, update) and its runner's
    (launch, shadow, sync) when the runner keeps them."""
    counters = dict(core.stats.phase_s)
    runner_phases = getattr(getattr(core, "runner", None), "phase_s", None)
    if runner_phases is not None:
        counters.update(runner_phases)
    return counters


def phases_text(phases: dict[str, float], rest_name: str, rest: float) -> str:
    """`schedule 0.10, runner 11.60 (launch 0.30, shadow 0.00, sync 11.20), update 0.05,
    <rest_name> 0.40`: the engine's phase figures (`phase_counters`' names, in one unit) and
    `rest`, the time outside them."""
    inner = ", ".join(f"{n} {phases[n]:.2f}" for n in RUNNER_PHASES if n in phases)
    schedule, runner, update = (phases.get(n, 0.0) for n in CORE_PHASES)
    runner_text = f"runner {runner:.2f}" + (f" ({inner})" if inner else "")
    return f"schedule {schedule:.2f}, {runner_text}, update {update:.2f}, {rest_name} {rest:.2f}"
