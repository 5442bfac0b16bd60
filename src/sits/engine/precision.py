"""`PrecisionControl`: the engine side of the runtime precision switch.

It runs on the engine's thread only. `set_precision` switches the runner's weight set at once
(between steps: the caller is the engine thread); each step is stamped, when it is run or
launched, with the set it runs and the switch count then (`mark_run`), so its outputs say
which weights made their tokens and how many switches each request has seen since its first
step (`stamp_outputs`), exactly also with async scheduling (a step launched before a switch
reports the old set). The last switch's step and delay are filled in by the first step that
runs in the new set.

Invariants: `state` is replaced, never mutated (other threads read it without a lock); the
per-request switch counts are dropped when a request finishes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import StepPlan
from sits.core.precision import PrecisionState
from sits.runner.model_runner import ModelRunner


@dataclasses.dataclass(slots=True)
class StepPrecision:
    """The weight set a step ran and the switch count when it was run.

    Attributes:
        precision: the set's name.
        num_switches: `PrecisionControl.num_switches` when the step was run or launched.
        first_of_switch: the first step run since the last switch.
    """

    precision: str
    num_switches: int
    first_of_switch: bool = False


class PrecisionControl:
    """The precision switch of one engine core (see the module docstring).

    Args:
        runner: the model runner, holding two weight sets.
        clock: the monotonic seconds clock the delays are measured with.

    Attributes:
        state: the latest `PrecisionState`.
    """

    def __init__(self, runner: ModelRunner, clock: Callable[[], float] = time.monotonic) -> None:
        self.runner = runner
        self.clock = clock
        self.state = PrecisionState(runner.precision, tuple(runner.models))
        self._called_s: float | None = None  # the unmeasured switch's call time
        self._first_switches: dict[str, int] = {}  # request id -> switch count at its first step

    @property
    def num_switches(self) -> int:
        return self.state.num_switches

    def set_precision(self, name: str, called_s: float | None = None) -> PrecisionState:
        """Run weight set `name` from the next step on.

        Args:
            name: one of `state.available`.
            called_s: clock seconds of the caller's request (default: now), for the delay.

        Returns:
            The state right after (its step and delay are filled in by the next step).

        Raises:
            InvalidParameterError: an unknown name ("precision").
        """
        self.runner.set_precision(name)  # raises for an unknown name
        if name == self.state.current:
            return self.state
        self._called_s = self.clock() if called_s is None else called_s
        self.state = dataclasses.replace(
            self.state,
            current=name,
            num_switches=self.state.num_switches + 1,
            last_switch_step=None,
            last_switch_unix_s=time.time(),
            last_switch_delay_s=None,
        )
        return self.state

    def mark_run(self, plan: StepPlan) -> StepPrecision:
        """Stamp a step as it is run or launched (its requests' first switch counts too)."""
        num_switches = self.state.num_switches
        first = self._first_switches
        for sr in plan.scheduled:
            if sr.request_id not in first:
                first[sr.request_id] = num_switches
        stamp = StepPrecision(self.runner.precision, num_switches)
        if self._called_s is not None and plan.scheduled:
            stamp.first_of_switch = True
            delay_s = max(self.clock() - self._called_s, 0.0)
            self.state = dataclasses.replace(self.state, last_switch_delay_s=delay_s)
            self._called_s = None
        return stamp

    def stamp_outputs(
        self, stamp: StepPrecision, step_number: int, outputs: Iterable[EngineCoreOutput]
    ) -> None:
        """Give a step's outputs its weight set and each request's switches since its first
        step; `step_number`: the step's `StepStats.num_steps`."""
        if stamp.first_of_switch and stamp.num_switches == self.state.num_switches:
            self.state = dataclasses.replace(self.state, last_switch_step=step_number)
        first = self._first_switches
        for out in outputs:
            out.precision = stamp.precision
            out.num_precision_switches = stamp.num_switches - first.get(
                out.request_id, stamp.num_switches
            )
            if out.finish_reason is not None:
                first.pop(out.request_id, None)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop finished requests' switch counts."""
        for request_id in request_ids:
            self._first_switches.pop(request_id, None)
