"""`EngineCore`: the engine's front door: add requests, abort them, run a step.

It is synchronous and single-threaded: `LLM` calls `step()` directly and `AsyncLLM`'s
`EngineLoop` calls it on the loop's thread (in the server process or a child process).
Messages in and out are plain dataclasses (`Request` in, `EngineCoreOutput` out), which the
engine process transport pickles.

A step has one path, `Stepper` (below): plan, run or launch, account; synchronous steps
(`Stepper.run_now`) and asynchronous ones (`sits.engine.async_step`, which launches a
`plan`ned step and later collects it) go through the same three functions:
1. `plan`: with the clock's `now_s`, drop the requests past their start deadline that never
   started, ask the step policy (`sits.sched.step_policy`: start deadlines, TPOT pacing, TTFT
   rescue, reclaim) for the prefill budget and due reclaims, and schedule
   (`Scheduler.schedule`);
2. `mark_run`: stamp the step with its weight set as it is run or launched (precision switch);
3. `account_step`: after `Scheduler.update`, count it (`StepStats`, in `sits.engine.stats`:
   load, cost and phase accounting, the prefill chunk log), feed the pacer and put the step's
   fields on its outputs.
The stepper also finishes requests from outside (`finish_requests`), so every finish forgets
the request in the policy, the counters and the precision switch alike.

Precision switch (`EngineConfig.precision_switch`): `set_precision` changes the runner's weight
set between steps (`sits.engine.precision`); every step is stamped when it is run or launched,
and its outputs carry its set and each request's switches since its first step.

Structured outputs: a constrained request waits in `grammar_gate` (`sits.engine.grammar_gate`),
not in the scheduler, until its grammar is compiled off the step loop; each step first admits
the compiled ones.

Invariants: the step's clock is read in `Stepper` only (the policy and the counters are given
its readings); one `account_step` per planned step that ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sits.config import (
    PROFILE_FILE_ENV,
    PROFILE_STEPS_ENV,
    STEP_SHAPES_ENV,
    EngineConfig,
    env_values,
)
from sits.core.errors import InvalidParameterError
from sits.core.limits import check_cache_holds_context
from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest, StepPlan
from sits.core.precision import PrecisionState, no_switch_state
from sits.core.request import START_DEADLINE_MISSED, FinishReason, Request
from sits.engine.async_step import StepPipeline
from sits.engine.grammar_gate import GrammarGate
from sits.engine.precision import PrecisionControl, StepPrecision
from sits.engine.stats import StepStats, prefills_of
from sits.engine.step_profile import profiler_from_env
from sits.engine.step_shapes import StepShapeRecorder, recorder_from_env
from sits.runner.model_info import ModelInfo
from sits.runner.model_runner import ModelRunner
from sits.runner.tp_executor import make_runner
from sits.sched.config import SchedulerConfig, SwapCostModel, TenantPolicy
from sits.sched.scheduler import Scheduler
from sits.sched.state import validate_request
from sits.sched.step_policy import StepPolicy, TpotPacer
from sits.sched.tenants import TenantSchedStats


@dataclass(frozen=True, slots=True)
class WaitingLoad:
    """One tenant's queued work.

    Attributes:
        oldest_arrival_s: time.monotonic() arrival of its oldest waiting request; None when
            none waits (it may still have running requests with prompt left to compute).
        num_prefill_tokens: tokens still to prefill: every token of each waiting request (new
            or preempted: all are computed again; prefix-cache hits not deducted) plus the
            prompt tokens its running requests have not computed yet (chunked prefill).
    """

    oldest_arrival_s: float | None = None
    num_prefill_tokens: int = 0


class EngineCore:
    """Scheduler + model runner behind add, abort and step.

    Args:
        config: engine configuration.
        info: the resolved checkpoint facts (see `read_model_info`).
        tenant_policies: the tenants' scheduling policies; empty (the default) schedules every
            request first-come-first-served whatever its tenant_id.

    Attributes:
        runner: the model runner (device state); with `tensor_parallel_size` > 1 rank 0's,
            which runs every step on the workers too (`sits.runner.tp_executor`).
        scheduler: the scheduler (KV block and batch decisions).
        policy: the step policy (`sits.sched.step_policy`): start deadlines, TPOT pacing
            (`policy.pacer`, on when a tenant has a TPOT SLO), TTFT rescue and reclaim.
        stats: the step counters (`sits.engine.stats.StepStats`): steps, prefill
            tokens and busy seconds, tenant cost shares, phases, the prefill chunk log.
        stepper: the step's one path (`Stepper`).
        pipeline: async scheduling's step pipeline, or None (synchronous steps).
        precision_control: the precision switch, or None without one.
        grammar_gate: constrained requests whose grammar is still compiling.
    """

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        tenant_policies: tuple[TenantPolicy, ...] = (),
    ) -> None:
        self.config = config
        self.info = info
        self.runner: ModelRunner = make_runner(config, info)  # one rank or several
        try:
            self._build(config, info, tenant_policies)
        except BaseException:
            self.runner.shutdown()  # no worker outlives a failed start
            raise

    def _build(
        self, config: EngineConfig, info: ModelInfo, tenant_policies: tuple[TenantPolicy, ...]
    ) -> None:
        """Everything but the runner: scheduler, step policy, counters, stepper.

        Raises:
            InvalidParameterError("max_model_len"): the KV cache cannot hold the model's own
                context and max_model_len was not set (`check_cache_holds_context`).
        """
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=info.max_model_len,
                block_size=config.block_size,
                num_blocks=self.runner.num_blocks,
                enable_prefix_caching=config.enable_prefix_caching,
                tenants=tuple(tenant_policies),
                num_host_blocks=self.runner.num_host_blocks,
                kv_bytes_per_block=self.runner.kv_bytes_per_block,
                swap_cost=SwapCostModel.for_device(self.runner.device.type),
            )
        )
        check_cache_holds_context(
            info.max_model_len,
            self.scheduler.num_total_blocks,
            config.block_size,
            explicit=config.max_model_len is not None,
        )
        pacer = TpotPacer(
            {p.tenant_id: p.tpot_ms / 1000 for p in tenant_policies if p.tpot_ms},
            config.max_num_batched_tokens,
            target_fraction=config.tpot_pacing_fraction,
            min_prefill_tokens=config.tpot_pacing_min_prefill_tokens,
            token_buckets=self.runner.step_token_buckets,
        )
        self.policy = StepPolicy(tenant_policies, pacer, config.max_num_batched_tokens)
        warmup = getattr(self.runner, "warmup", None)
        self.stats = StepStats(
            representative_prefill_tokens=max(1, config.max_num_batched_tokens // 4),
            prefill_rate_seed_tokens_per_s=warmup.prefill_tokens_per_s if warmup else None,
        )
        self.step_shapes = recorder_from_env(env_values(STEP_SHAPES_ENV))  # for replays
        self.step_profiler = profiler_from_env(env_values(PROFILE_STEPS_ENV, PROFILE_FILE_ENV))
        self.precision_control = (
            PrecisionControl(self.runner) if config.precision_switch is not None else None
        )
        self.stepper = Stepper(
            self.scheduler,
            self.runner,
            self.policy,
            self.stats,
            self.precision_control,
            self.step_shapes,
        )
        self.pipeline = StepPipeline(self.stepper) if config.async_scheduling else None
        self.grammar_gate = GrammarGate(lambda: self.runner.grammar_rows.cache)

    def shutdown(self) -> None:
        """Release the runner (`ModelRunner.shutdown`: joins tensor-parallel workers); no step
        may follow. Idempotent."""
        self.runner.shutdown()

    @property
    def clock(self) -> Callable[[], float]:
        """The seconds clock the steps read (`Stepper.clock`; time.monotonic by default)."""
        return self.stepper.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.stepper.clock = clock

    def set_precision(self, name: str, called_s: float | None = None) -> PrecisionState:
        """Run weight set `name` from the next step on (call between steps).

        Args:
            name: one of `precision_state().available`.
            called_s: time.monotonic() of the caller's request, for the switch delay.

        Raises:
            InvalidParameterError: no precision switch configured, or an unknown name
                ("precision").
        """
        if self.precision_control is None:
            raise InvalidParameterError(
                "precision",
                "this engine has no precision switch (start it with --precision-switch fp8 "
                "or int4)",
            )
        return self.precision_control.set_precision(name, called_s)

    def precision_state(self) -> PrecisionState:
        """The weight sets and the last switch (one set without a precision switch)."""
        if self.precision_control is None:
            return no_switch_state(self.runner.precision)
        return self.precision_control.state

    def add_request(self, request: Request) -> None:
        """Queue a request; its limits (`Request.max_tokens`, context, whole KV cache) are
        checked once, by `Scheduler.add_request` (`sits.core.limits.resolve_limits`).

        A constrained request whose grammar is not compiled yet waits in `grammar_gate`
        (checked here all the same, so it fails now rather than when admitted).

        Raises:
            InvalidParameterError: a token id outside the vocabulary ("prompt"), structured
                outputs without a tokenizer ("structured_outputs"), or as
                `Scheduler.add_request` (empty prompt, request id in use, unknown tenant).
            PromptTooLongError: prompt + max_tokens exceeds max_model_len or the whole KV cache.
        """
        prompt_token_ids = request.prompt_token_ids
        vocab_size = self.runner.model.arch.vocab_size
        if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size):
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
            raise InvalidParameterError(
                "prompt", f"token id {bad} is outside the vocabulary [0, {vocab_size})"
            )
        if request.sampling_params.structured_outputs is not None:
            validate_request(request, self.scheduler.config)
            if self.grammar_gate.hold(request):
                return
        self.scheduler.add_request(request)
        self.policy.add_request(request)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move the requests whose grammar compiled to the scheduler (waiting a little for
        one when nothing else can run); the outputs of those whose compile failed."""
        gate = self.grammar_gate
        if not self.scheduler.has_unfinished_requests() and not (
            self.pipeline is not None and self.pipeline.busy
        ):
            gate.wait()
        ready, failed = gate.admit()
        for request in ready:
            self.scheduler.add_request(request)
            self.policy.add_request(request)
        return failed

    def finish_requests(
        self,
        request_ids: list[str],
        reason: FinishReason = FinishReason.ABORT,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort, stop string); frees their blocks at once
        (`Stepper.finish_requests`; held ones leave `grammar_gate`)."""
        held = self.grammar_gate.cancel(request_ids, reason) if self.grammar_gate else []
        return held + self.stepper.finish_requests(request_ids, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished (held ones too), or (async scheduling) a step to collect."""
        if (self.pipeline is not None and self.pipeline.busy) or self.grammar_gate:
            return True
        return self.scheduler.has_unfinished_requests()

    def tenant_stats(self) -> dict[str, TenantSchedStats]:
        """Per configured tenant: running, waiting, blocks used/reserved/borrowed (empty without
        tenants)."""
        return self.scheduler.tenant_stats()

    def waiting_load(self) -> dict[str, WaitingLoad]:
        """The queued work of each tenant id that has some (see `WaitingLoad`).
        O(running requests + tenants) (`Scheduler.queued_prefill`)."""
        return {
            tenant_id: WaitingLoad(oldest_s, num_tokens)
            for tenant_id, (oldest_s, num_tokens) in self.scheduler.queued_prefill().items()
        }

    def step(self, while_gpu_runs: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """Run one engine step.

        With `config.async_scheduling` the next step is planned and launched before this one's
        tokens are read back (`sits.engine.async_step`), so the host's planning overlaps the
        device; the outputs are the same, one step at a time.

        Args:
            while_gpu_runs: host work to do while the step's forward runs on the device
                (`ModelRunner.run`); not called when nothing was scheduled.

        Returns:
            One output per request that produced tokens, logprobs or finished this step.
        """
        failed = self._admit_compiled() if self.grammar_gate else []
        if self.step_profiler is not None:
            self.step_profiler.before_step(self.stats.num_steps + 1)
        if self.pipeline is not None:
            outputs = self.pipeline.step(while_gpu_runs)
        else:
            outputs = self.stepper.run_now(self.stepper.plan(), while_gpu_runs)[0]
        if self.step_profiler is not None:
            self.step_profiler.after_step(self.stats.num_steps)
        return failed + outputs if failed else outputs


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
