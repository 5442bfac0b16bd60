"""Async scheduling: plan and launch step N+1 while the device runs step N.

In a synchronous step the device idles while the host reads step N's tokens back, updates the
scheduler, plans step N+1 and prepares its inputs: at 256 sequences several ms of every
~20-25 ms decode step on an H200. `StepPipeline` (on with `EngineConfig.async_scheduling`, as
vLLM's `--async-scheduling`) keeps one step in flight instead. It plans, launches and accounts
steps through the same `Stepper` functions as a synchronous step. Each `EngineCore.step()` call:
1. the in-flight step N is applied ahead (`Scheduler.update_ahead`: computed tokens advance,
   sampled requests get a placeholder token, requests that surely end with N are set aside);
2. step N+1 is planned and launched (`ModelRunner.launch`): its placeholder input ids are read
   on the device from N's sampled tokens, so it queues behind N without waiting for the host;
3. `while_gpu_runs`, then N's tokens are read back (`ModelRunner.collect`) and applied
   (`Scheduler.update`: placeholders resolved, stop checks, outputs) while N+1 runs.
Outputs are those of step N, exactly what a synchronous engine reports for it.

What differs from the synchronous engine, by design (as in vLLM's async scheduling):
- A request that ends on a stop token or EOS sampled in step N was planned into step N+1; that
  decode's token is dropped (its KV lands in blocks freed after N+1 in stream order).
- A request whose sampling needs earlier tokens on the host (logprobs, prompt logprobs or
  penalties: `runner.needs_host_tokens`) is in no launched-ahead step: a plan holding one runs
  synchronously once the step before it is collected (its placeholders filled in on the host).

Invariants: at most one step is in flight; the device runs the steps in launch order on one
stream, so a step's KV writes, block reuse and input buffers never race the step before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import PLACEHOLDER_TOKEN_ID, StepResult
from sits.runner.model_runner import LaunchedStep

if TYPE_CHECKING:  # core builds the pipeline; these are its annotations only
    from sits.engine.core import PlannedStep, Stepper


class StepPipeline:
    """One step in flight ahead of the host (see the module docstring).

    Args:
        stepper: the step path (scheduler, runner, planning and accounting) it drives.

    Attributes:
        busy: a step is launched and not collected, or a planned step waits to run.
    """

    def __init__(self, stepper: Stepper) -> None:
        self.stepper = stepper
        self._in_flight: tuple[PlannedStep, LaunchedStep] | None = None
        self._waiting: PlannedStep | None = None  # planned, to run synchronously next
        self._device_free_s = 0.0  # when the last collected step's tokens were back

    @property
    def busy(self) -> bool:
        return self._in_flight is not None or self._waiting is not None

    def step(self, while_gpu_runs: Callable[[], None] | None) -> list[EngineCoreOutput]:
        """Collect one step (launching the next first when it can); its outputs."""
        stepper = self.stepper
        runner = stepper.runner
        if self._waiting is not None:
            planned, self._waiting = self._waiting, None
            return self._run_now(planned, while_gpu_runs)
        clock = stepper.clock
        runner_s = 0.0  # host time in launching and waiting (the "runner" phase)
        if self._in_flight is None:
            planned = stepper.plan()
            if planned.plan.is_empty or not runner.can_launch(planned.plan):
                return self._run_now(planned, while_gpu_runs)
            start_s = clock()
            stepper.mark_run(planned)
            self._in_flight = (planned, runner.launch(planned.plan, None))
            runner_s += clock() - start_s
        planned, launched = self._in_flight
        self._in_flight = None
        stepper.scheduler.update_ahead(planned.plan)
        following = stepper.plan()
        expired, following.expired = following.expired, []  # reported with this step
        if following.plan.is_empty:
            # Nothing to compute, but maybe swap copies and finished ids for the runner (a
            # request set aside as ending with step N can leave another none of the blocks).
            runner.run(following.plan)
        elif runner.can_launch(following.plan):
            start_s = clock()
            stepper.mark_run(following)
            self._in_flight = (following, runner.launch(following.plan, launched))
            runner_s += clock() - start_s
        else:
            self._waiting = following
        if while_gpu_runs is not None:
            while_gpu_runs()
        start_s = clock()
        result = runner.collect(launched)
        ran_s = clock()
        runner_s += ran_s - start_s
        if self._waiting is not None:
            _fill_placeholders(self._waiting, result)
        outputs = stepper.scheduler.update(planned.plan, result)
        started_s = max(planned.scheduled_s, self._device_free_s)
        self._device_free_s = ran_s
        outputs = stepper.account_step(planned, ran_s, outputs, started_s, runner_s)
        return expired + outputs if expired else outputs

    def _run_now(
        self, planned: PlannedStep, while_gpu_runs: Callable[[], None] | None
    ) -> list[EngineCoreOutput]:
        """Run a planned step synchronously (`Stepper.run_now`)."""
        outputs, self._device_free_s = self.stepper.run_now(planned, while_gpu_runs)
        return outputs


def _fill_placeholders(planned: PlannedStep, result: StepResult) -> None:
    """Put the tokens of the step just collected into a plan made before they were known, for
    a synchronous run (a placeholder is always a scheduled request's last token)."""
    sampled = result.sampled_token_ids
    for sr in planned.plan.scheduled:
        if sr.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
            sr.token_ids[-1] = sampled[sr.request_id]
