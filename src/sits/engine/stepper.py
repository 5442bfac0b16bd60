"""`Stepper`: the one path of an engine step: plan, run (or launch), account.

Synchronous steps (`Stepper.run_now`) and asynchronous ones (`sits.engine.async_step`, which
launches a `plan`ned step and later collects it) go through the same three functions:
1. `plan`: with the clock's `now_s`, drop the requests past their start deadline that never
   started, ask the step policy (`sits.sched.step_policy`) for the prefill budget and due
   reclaims, and schedule (`Scheduler.schedule`);
2. `mark_run`: stamp the step with its weight set as it is run or launched (precision switch);
3. `account_step`: after `Scheduler.update`, count it (`StepStats`), feed the pacer and put
   the step's fields on its outputs.
It also finishes requests from outside (`finish_requests`), so every finish forgets the
request in the policy, the counters and the precision switch alike.

Invariants: the clock is read here only (the policy and the counters are given its readings);
one `account_step` per planned step that ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest, StepPlan
from sits.core.request import START_DEADLINE_MISSED, FinishReason
from sits.engine.precision import PrecisionControl, StepPrecision
from sits.engine.step_shapes import StepShapeRecorder
from sits.engine.step_stats import StepStats, prefills_of
from sits.runner.model_runner import ModelRunner
from sits.sched.scheduler import Scheduler
from sits.sched.step_policy import StepPolicy


@dataclass(slots=True)
class PlannedStep:
    """A scheduled step on its way through the runner (`Stepper.plan`).

    Attributes:
        plan: the scheduler's plan.
        start_s: clock seconds when planning began; scheduled_s: when the plan was made.
        expired: outputs of requests dropped at their start deadline before planning.
        prefills: its prompt chunks and recomputes (counted before `update`).
        tokens_by_tenant: tokens scheduled per tenant (`Scheduler.last_tokens_by_tenant`).
        precision: its weight set and switch count, stamped when it is run or launched
            (`Stepper.mark_run`; None without a precision switch).
    """

    plan: StepPlan
    start_s: float
    scheduled_s: float
    expired: list[EngineCoreOutput]
    prefills: list[ScheduledRequest]
    tokens_by_tenant: dict[str, int]
    precision: StepPrecision | None = None


class Stepper:
    """Plans, runs and accounts steps over one scheduler and runner (module docstring).

    Args:
        scheduler: the scheduler; runner: the model runner.
        policy: the step policy (start deadlines, pacing, TTFT rescue, reclaim).
        stats: the step counters.
        precision_control: the precision switch, or None without one.
        step_shapes: the step-shape recorder (for replays), or None.

    Attributes:
        clock: the seconds clock the steps read (time.monotonic; a simulation with a modelled
            device sets its own, e.g. `bench/qos_sim.py`'s virtual clock).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        policy: StepPolicy,
        stats: StepStats,
        precision_control: PrecisionControl | None,
        step_shapes: StepShapeRecorder | None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.policy = policy
        self.stats = stats
        self.precision_control = precision_control
        self.step_shapes = step_shapes
        self.clock: Callable[[], float] = time.monotonic

    def finish_requests(
        self,
        request_ids: list[str],
        reason: FinishReason = FinishReason.ABORT,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort, stop string, start deadline); frees their
        blocks at once. Returns their outputs (`Scheduler.finish_requests`)."""
        self.policy.forget(request_ids)
        if self.precision_control is not None:
            self.precision_control.forget(request_ids)
        for request_id in request_ids:
            self.stats.forget(request_id, self.scheduler.get_request(request_id))
        return self.scheduler.finish_requests(request_ids, reason, stop_reason)

    def plan(self) -> PlannedStep:
        """Drop requests past their start deadline, then schedule under the policy's
        decision (see the module docstring)."""
        start_s = self.clock()
        sched = self.scheduler
        expired = []
        due = self.policy.due_unstarted(start_s, sched)
        if due:
            expired = self.finish_requests(due, FinishReason.ABORT, START_DEADLINE_MISSED)
        decision = self.policy.decide(start_s, sched)
        plan = sched.schedule(decision.max_prefill_tokens, decision.reclaim_tenants)
        scheduled_s = self.clock()
        self.stats.note_scheduled(plan, start_s, scheduled_s)
        return PlannedStep(
            plan, start_s, scheduled_s, expired, prefills_of(plan), sched.last_tokens_by_tenant
        )

    def mark_run(self, planned: PlannedStep) -> None:
        """Stamp a step with its weight set as it is run or launched (precision switch)."""
        if self.precision_control is not None:
            planned.precision = self.precision_control.mark_run(planned.plan)

    def run_now(
        self, planned: PlannedStep, while_gpu_runs: Callable[[], None] | None = None
    ) -> tuple[list[EngineCoreOutput], float]:
        """Run a planned step synchronously (`ModelRunner.run`), update and account it.

        Returns:
            (its outputs, the clock seconds when its tokens were back).
        """
        self.mark_run(planned)
        result = self.runner.run(planned.plan, while_gpu_runs)
        ran_s = self.clock()
        outputs = self.scheduler.update(planned.plan, result)
        return self.account_step(planned, ran_s, outputs), ran_s

    def account_step(
        self,
        planned: PlannedStep,
        ran_s: float,
        outputs: list[EngineCoreOutput],
        device_start_s: float | None = None,
        runner_s: float | None = None,
    ) -> list[EngineCoreOutput]:
        """Counters, tenant charges, pacing and output fields of a step whose `update` gave
        `outputs`. ran_s: when its tokens were back. The step's time runs from its planning
        (its prefill time from its plan) to the end of its update; with async scheduling from
        `device_start_s`, when the device could start it (launched, the step before done),
        and its "runner" phase is `runner_s`, the host's time in launching it and in waiting
        for its tokens.

        Returns:
            The step's outputs, its start-deadline expiries first.
        """
        plan, scheduled_s, prefills = planned.plan, planned.scheduled_s, planned.prefills
        if self.step_shapes is not None and plan.scheduled:
            self.step_shapes.record(plan, ran_s - scheduled_s)
        end_s = self.clock()
        if device_start_s is None:
            busy_s, step_s = end_s - scheduled_s, end_s - planned.start_s
            chunk_s = (scheduled_s, end_s)
        else:  # async: the device ran it from device_start_s until its tokens were back
            busy_s = step_s = end_s - device_start_s
            chunk_s = (device_start_s, ran_s)
        stats = self.stats
        stats.account_step(
            plan,
            prefills,
            planned.tokens_by_tenant,
            step_s,
            busy_s,
            chunk_s,
            ran_s - scheduled_s if runner_s is None else runner_s,
            end_s - ran_s,
        )
        if plan.scheduled:
            num_decodes = len(plan.scheduled) - len(prefills)
            self.policy.observe_step(num_decodes, prefills, step_s, end_s, outputs)
        stats.annotate(outputs)
        if planned.precision is not None:
            assert self.precision_control is not None
            self.precision_control.stamp_outputs(planned.precision, stats.num_steps, outputs)
        expired = planned.expired
        return expired + outputs if expired else outputs
