"""`EngineCore`: the engine's front door: add requests, abort them, run a step.

It is synchronous and single-threaded: `LLM` calls `step()` directly and `AsyncLLM`'s
`EngineLoop` calls it on the loop's thread (in the server process or a child process).
Messages in and out are plain dataclasses (`Request` in, `EngineCoreOutput` out), which the
engine process transport pickles.

What a step does lives elsewhere, one concern per module: the per-step scheduling policy
(start deadlines, TPOT pacing, TTFT rescue, reclaim) in `sits.sched.step_policy`, the step's
one path (plan, run or launch, account; synchronous and asynchronous alike) in
`sits.engine.stepper`, async scheduling's pipeline in `sits.engine.async_step`, and the step
counters (load, cost and phase accounting, the prefill chunk log) in `sits.engine.step_stats`.

Precision switch (`EngineConfig.precision_switch`): `set_precision` changes the runner's weight
set between steps (`sits.engine.precision`); every step is stamped when it is run or launched,
and its outputs carry its set and each request's switches since its first step.
"""

from __future__ import annotations

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
from sits.core.outputs import EngineCoreOutput
from sits.core.precision import PrecisionState
from sits.core.request import FinishReason, Request
from sits.engine.async_step import StepPipeline
from sits.engine.precision import PrecisionControl, no_switch_state
from sits.engine.step_profile import profiler_from_env
from sits.engine.step_shapes import recorder_from_env
from sits.engine.step_stats import StepStats
from sits.engine.stepper import Stepper
from sits.runner.model_info import ModelInfo
from sits.runner.model_runner import ModelRunner
from sits.sched.config import SchedulerConfig, SwapCostModel, TenantPolicy
from sits.sched.pacing import TpotPacer
from sits.sched.scheduler import Scheduler
from sits.sched.step_policy import StepPolicy
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
        runner: the model runner (device state).
        scheduler: the scheduler (KV block and batch decisions).
        policy: the step policy (`sits.sched.step_policy`): start deadlines, TPOT pacing
            (`policy.pacer`, on when a tenant has a TPOT SLO), TTFT rescue and reclaim.
        stats: the step counters (`sits.engine.step_stats.StepStats`): steps, prefill
            tokens and busy seconds, tenant cost shares, phases, the prefill chunk log.
        stepper: the step's one path (`sits.engine.stepper.Stepper`).
        pipeline: async scheduling's step pipeline, or None (synchronous steps).
        precision_control: the precision switch, or None without one.
    """

    def __init__(
        self,
        config: EngineConfig,
        info: ModelInfo,
        tenant_policies: tuple[TenantPolicy, ...] = (),
    ) -> None:
        self.config = config
        self.info = info
        self.runner = ModelRunner(config, info)
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
        pacer = TpotPacer(
            {p.tenant_id: p.tpot_ms / 1000 for p in tenant_policies if p.tpot_ms},
            config.max_num_batched_tokens,
            target_fraction=config.tpot_pacing_fraction,
            min_prefill_tokens=config.tpot_pacing_min_prefill_tokens,
            token_buckets=self.runner.step_token_buckets,
        )
        self.policy = StepPolicy(tenant_policies, pacer, config.max_num_batched_tokens)
        self.stats = StepStats()
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
            return no_switch_state(self.runner)
        return self.precision_control.state

    def add_request(self, request: Request) -> None:
        """Queue a request; its limits (`Request.max_tokens`, context, whole KV cache) are
        checked once, by `Scheduler.add_request` (`sits.core.limits.resolve_limits`).

        Raises:
            InvalidParameterError: a token id outside the vocabulary ("prompt"), or as
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
        self.scheduler.add_request(request)
        self.policy.add_request(request)

    def finish_requests(
        self,
        request_ids: list[str],
        reason: FinishReason = FinishReason.ABORT,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort, stop string); frees their blocks at once
        (`Stepper.finish_requests`)."""
        return self.stepper.finish_requests(request_ids, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or (async scheduling) a step still to collect."""
        if self.pipeline is not None and self.pipeline.busy:
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
        if self.step_profiler is not None:
            self.step_profiler.before_step(self.stats.num_steps + 1)
        if self.pipeline is not None:
            outputs = self.pipeline.step(while_gpu_runs)
        else:
            outputs = self.stepper.run_now(self.stepper.plan(), while_gpu_runs)[0]
        if self.step_profiler is not None:
            self.step_profiler.after_step(self.stats.num_steps)
        return outputs
