"""`EngineCore`: the step loop's body: schedule, run the model, update, report.

It is synchronous and single-threaded: `LLM` calls `step()` directly and `AsyncLLM` calls it
from its own engine thread. Messages in and out are plain dataclasses (`Request` in,
`EngineCoreOutput` out), so the core can later move into its own process.

Load accounting for overload control (read by `AsyncLLM` for its stats): cumulative prefill
tokens computed and the wall time of the steps that computed them (`num_prefill_tokens`,
`prefill_busy_s`; their ratio is a prefill rate), and `waiting_load()` (per tenant: oldest
waiting arrival and prefill work still queued).

Cost accounting: each step's wall time (schedule + run + update) is added to `busy_s` and split
among the tenants of its scheduled requests in proportion to their scheduled tokens
(`split_step_time`; a prefill token and a decode token weigh the same), accumulated in
`tenant_busy_s`; so the tenants' shares always add up to `busy_s`. The prompt chunks (and
recomputes) of the last `MAX_PREFILL_CHUNK_LOG` scheduled prefills are kept in the bounded
`prefill_chunks` ring (request timelines on the dashboard; read it on the engine's thread).

Precision switch (`EngineConfig.precision_switch`): `set_precision` changes the runner's weight
set between steps (`sits.engine.precision`); every step is stamped when it is run or launched,
and its outputs carry its set and each request's switches since its first step.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Mapping
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
from sits.core.plan import ScheduledRequest, StepPlan
from sits.core.precision import PrecisionState
from sits.core.request import START_DEADLINE_MISSED, FinishReason, Request, RequestStatus
from sits.engine.async_step import StepPipeline
from sits.engine.precision import PrecisionControl, StepPrecision, no_switch_state
from sits.engine.step_profile import profiler_from_env
from sits.engine.step_shapes import recorder_from_env
from sits.runner.model_info import ModelInfo
from sits.runner.model_runner import ModelRunner
from sits.sched.config import SchedulerConfig, SwapCostModel, TenantPolicy
from sits.sched.pacing import TTFT_RESCUE_SLACK, TpotPacer, ttft_rescue_tenants
from sits.sched.scheduler import Scheduler
from sits.sched.tenants import TenantSchedStats

MAX_PREFILL_CHUNK_LOG = 4096
# A guaranteed tenant preempts borrowers for its reservation once its oldest waiting request
# has used this fraction of its TTFT SLO; before that, requests finishing free the capacity at
# no recompute cost (with 200+ running, a few finish every step). On the H200 QoS runs the
# guaranteed tenant's TTFT p99 stayed at ~425 ms of 1 s with it (bench/RESULTS.md).
RECLAIM_PATIENCE = 0.25


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One prompt chunk (or recompute after preemption) of a request, computed in one step.

    Attributes:
        request_id: engine request id.
        start_s, end_s: time.monotonic() seconds when the step's model run began and when the
            step ended (the chunk shares the step with the rest of the batch).
        start_position: position of the chunk's first token.
        num_tokens: tokens computed.
    """

    request_id: str
    start_s: float
    end_s: float
    start_position: int
    num_tokens: int


@dataclass(slots=True)
class PlannedStep:
    """A scheduled step on its way through the runner (`EngineCore.plan_step`).

    Attributes:
        plan: the scheduler's plan.
        start_s: clock seconds when planning began; scheduled_s: when the plan was made.
        expired: outputs of requests dropped at their start deadline before planning.
        prefills: its prompt chunks and recomputes (counted before `update`).
        tokens_by_tenant: tokens scheduled per tenant (`Scheduler.last_tokens_by_tenant`).
        precision: its weight set and switch count, stamped when it is run or launched
            (`EngineCore.mark_run`; None without a precision switch).
    """

    plan: StepPlan
    start_s: float
    scheduled_s: float
    expired: list[EngineCoreOutput]
    prefills: list[ScheduledRequest]
    tokens_by_tenant: dict[str, int]
    precision: StepPrecision | None = None


def split_step_time(tokens_by_tenant: Mapping[str, int], step_s: float) -> dict[str, float]:
    """Each tenant's share of one step's wall time, in proportion to its scheduled tokens.

    Args:
        tokens_by_tenant: tenant id -> tokens scheduled for it in the step (> 0 in all).
        step_s: the step's wall time in seconds.

    Returns:
        tenant id -> seconds; the values add up to `step_s` (up to float rounding).
    """
    total = sum(tokens_by_tenant.values())
    if total <= 0:
        return {}
    return {tenant_id: step_s * n / total for tenant_id, n in tokens_by_tenant.items()}


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
    """Scheduler + model runner.

    Args:
        config: engine configuration.
        info: the resolved checkpoint facts (see `read_model_info`).
        tenant_policies: the tenants' scheduling policies; empty (the default) schedules every
            request first-come-first-served whatever its tenant_id.

    Attributes:
        runner: the model runner (device state).
        scheduler: the scheduler (KV block and batch decisions).
        pacer: TPOT pacing of prefill tokens per step, on when a tenant has a TPOT SLO; first
            tokens at risk lift it for their prompts (`sits.sched.pacing`).
        num_steps: steps run so far.
        num_prefill_tokens: prompt (or recomputed) tokens computed so far, cumulative.
        prefill_busy_s: wall seconds of the steps that computed prefill tokens, cumulative
            (the whole step counts, decodes batched with the prefill included).
        busy_s: wall seconds of every step that scheduled tokens, cumulative.
        tenant_busy_s: tenant id -> its share of `busy_s` (see the module docstring).
        tenant_scheduled_tokens: tenant id -> tokens scheduled for it so far (prompt chunks,
            recomputes and decodes).
        prefill_chunks: the latest prefill chunks, oldest first (bounded ring).
        phase_s: cumulative wall seconds of the step's phases: "schedule" (pacing and the
            scheduler), "runner" (inputs, model, sampling) and "update" (scheduler update and
            outputs); read by the engine loop's profile (`sits.engine.loop_profile`).
        num_decode_rows: one-token decodes scheduled so far, cumulative.
        num_prefill_chunks: prompt (or recompute) chunks scheduled so far, cumulative.
        num_wasted_prefill_tokens: computed prompt tokens of requests finished from outside
            before their first token (e.g. shed by a queue timeout), cumulative.
        record_request_chunks: when True (tracing), each request's prompt chunks (and
            recomputes) travel on its next output as `EngineCoreOutput.prefill_chunks`:
            (step end time.monotonic(), tokens) per chunk since its previous output.
        clock: the seconds clock `step` reads (time.monotonic; a simulation with a modelled
            device sets its own, e.g. `bench/qos_sim.py`'s virtual clock).
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
        self.pacer = TpotPacer(
            {p.tenant_id: p.tpot_ms / 1000 for p in tenant_policies if p.tpot_ms},
            config.max_num_batched_tokens,
            target_fraction=config.tpot_pacing_fraction,
            min_prefill_tokens=config.tpot_pacing_min_prefill_tokens,
            token_buckets=self.runner.step_token_buckets,
        )
        self._rescue_tenants = ttft_rescue_tenants(tenant_policies)
        self._has_tenants = bool(tenant_policies)
        self._start_deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.prefill_busy_s = 0.0
        self.busy_s = 0.0
        self.tenant_busy_s: dict[str, float] = {}
        self.tenant_scheduled_tokens: dict[str, int] = {}
        self.phase_s = {"schedule": 0.0, "runner": 0.0, "update": 0.0}
        self.num_decode_rows = 0
        self.num_prefill_chunks = 0
        self.num_wasted_prefill_tokens = 0
        self.clock: Callable[[], float] = time.monotonic
        self.step_shapes = recorder_from_env(env_values(STEP_SHAPES_ENV))  # for replays
        self.step_profiler = profiler_from_env(env_values(PROFILE_STEPS_ENV, PROFILE_FILE_ENV))
        self.prefill_chunks: deque[PrefillChunk] = deque(maxlen=MAX_PREFILL_CHUNK_LOG)
        self._first_scheduled_s: dict[str, float] = {}
        self._unreported_first_scheduled: set[str] = set()
        self.record_request_chunks = False
        self._unreported_chunks: dict[str, list[tuple[float, int]]] = {}
        self.pipeline = StepPipeline(self) if config.async_scheduling else None
        self.precision_control = (
            PrecisionControl(self.runner) if config.precision_switch is not None else None
        )

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

    def mark_run(self, planned: PlannedStep) -> None:
        """Stamp a step with its weight set as it is run or launched (precision switch)."""
        if self.precision_control is not None:
            planned.precision = self.precision_control.mark_run(planned.plan)

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
        if request.start_deadline_s is not None:
            heapq.heappush(self._start_deadlines, (request.start_deadline_s, request.request_id))

    def finish_requests(
        self,
        request_ids: list[str],
        reason: FinishReason = FinishReason.ABORT,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """Finish requests from outside (abort, stop string); frees their blocks at once."""
        self.pacer.forget(request_ids)
        if self.precision_control is not None:
            self.precision_control.forget(request_ids)
        for request_id in request_ids:
            request = self.scheduler.get_request(request_id)
            if request is not None and request.num_output_tokens == 0:
                prompt_done = min(request.num_computed_tokens, request.num_prompt_tokens)
                self.num_wasted_prefill_tokens += prompt_done
            self._first_scheduled_s.pop(request_id, None)
            self._unreported_first_scheduled.discard(request_id)
            self._unreported_chunks.pop(request_id, None)
        return self.scheduler.finish_requests(request_ids, reason, stop_reason)

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
            self.step_profiler.before_step(self.num_steps + 1)
        if self.pipeline is not None:
            outputs = self.pipeline.step(while_gpu_runs)
        else:
            outputs = self.run_planned(self.plan_step(), while_gpu_runs)[0]
        if self.step_profiler is not None:
            self.step_profiler.after_step(self.num_steps)
        return outputs

    def run_planned(
        self, planned: PlannedStep, while_gpu_runs: Callable[[], None] | None = None
    ) -> tuple[list[EngineCoreOutput], float]:
        """Run a planned step synchronously (`ModelRunner.run`), update and account it.

        Returns:
            (its outputs, the clock seconds when its tokens were back).
        """
        self.mark_run(planned)
        result = self.runner.run(planned.plan, while_gpu_runs)
        ran_s = self.clock()
        return self.account_step(planned, ran_s, self.scheduler.update(planned.plan, result)), ran_s

    def plan_step(self) -> PlannedStep:
        """Drop requests past their start deadline, then schedule (with pacing and reclaims)."""
        start_s = self.clock()
        expired = self._drop_unstarted(start_s) if self._start_deadlines else []
        max_prefill_tokens = None
        if self.pacer.enabled:
            running = self.scheduler.running_requests()
            max_prefill_tokens = self.pacer.max_prefill_tokens(start_s, running)
            if max_prefill_tokens is not None and self._rescue_tenants:
                at_risk = self.scheduler.prompt_tokens_at_risk(
                    start_s, TTFT_RESCUE_SLACK, self._rescue_tenants
                )
                budget = self.config.max_num_batched_tokens
                max_prefill_tokens = max(max_prefill_tokens, min(at_risk, budget))
        reclaim = None
        if self._has_tenants:
            reclaim = self.scheduler.reclaim_due_tenants(start_s, RECLAIM_PATIENCE)
        plan = self.scheduler.schedule(max_prefill_tokens, reclaim)
        now = self.clock()
        self.phase_s["schedule"] += now - start_s
        # The loops over every scheduled request and output below run in every step (256
        # decodes: ~0.1 ms of host time on our CPU), so they read fields, not properties.
        first_scheduled_s = self._first_scheduled_s
        for sr in plan.scheduled:
            if sr.request_id not in first_scheduled_s:
                first_scheduled_s[sr.request_id] = now
                self._unreported_first_scheduled.add(sr.request_id)
        # Prompt chunks and recomputes: not a one-token decode of a request with outputs.
        # Counted before `update`, which appends to the (shared) output_token_ids lists.
        prefills = [sr for sr in plan.scheduled if len(sr.token_ids) > 1 or not sr.output_token_ids]
        return PlannedStep(
            plan, start_s, now, expired, prefills, self.scheduler.last_tokens_by_tenant
        )

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
        plan, now, prefills = planned.plan, planned.scheduled_s, planned.prefills
        if self.step_shapes is not None and plan.scheduled:
            self.step_shapes.record(plan, ran_s - now)
        end_s = self.clock()
        if device_start_s is None:
            busy_s, step_s = end_s - now, end_s - planned.start_s
            chunk_start_s, chunk_end_s = now, end_s
        else:  # async: the device ran it from device_start_s until its tokens were back
            busy_s = step_s = end_s - device_start_s
            chunk_start_s, chunk_end_s = device_start_s, ran_s
        phase_s = self.phase_s
        phase_s["runner"] += ran_s - now if runner_s is None else runner_s
        phase_s["update"] += end_s - ran_s
        num_decodes = len(plan.scheduled) - len(prefills)
        self.num_decode_rows += num_decodes
        self.num_steps += 1
        num_prefill_tokens = sum(sr.num_tokens for sr in prefills)
        if prefills:
            self.num_prefill_tokens += num_prefill_tokens
            self.num_prefill_chunks += len(prefills)
            self.prefill_busy_s += busy_s
            self.prefill_chunks.extend(
                PrefillChunk(
                    sr.request_id, chunk_start_s, chunk_end_s, sr.start_position, sr.num_tokens
                )
                for sr in prefills
            )
            if self.record_request_chunks:
                for sr in prefills:
                    chunks = self._unreported_chunks.setdefault(sr.request_id, [])
                    chunks.append((chunk_end_s, sr.num_tokens))
        self._charge(planned.tokens_by_tenant, step_s)
        if self.pacer.enabled and plan.scheduled:
            step_tokens = num_decodes + num_prefill_tokens
            self.pacer.observe_step(
                self.pacer.padded_tokens(step_tokens) if prefills else 0,
                step_s,
                end_s,
                (out.request_id for out in outputs if out.new_token_ids),
                (out.request_id for out in outputs if out.finished),
            )
        first_scheduled_s = self._first_scheduled_s
        unreported_first = self._unreported_first_scheduled
        unreported_chunks = self._unreported_chunks
        for out in outputs:
            request_id = out.request_id
            if request_id in unreported_first:
                unreported_first.discard(request_id)
                out.first_scheduled_time = first_scheduled_s[request_id]
            if unreported_chunks:
                out.prefill_chunks = unreported_chunks.pop(request_id, None)
            if out.finish_reason is not None:  # finished
                first_scheduled_s.pop(request_id, None)
        if planned.precision is not None:
            self.precision_control.stamp_outputs(planned.precision, self.num_steps, outputs)
        expired = planned.expired
        return expired + outputs if expired else outputs

    def _drop_unstarted(self, now_s: float) -> list[EngineCoreOutput]:
        """Finish the requests past their `start_deadline_s` that never started (no computed
        tokens, no output; for a follower of an n>1 request, its leader neither): finish ABORT,
        stop_reason `START_DEADLINE_MISSED`. Their outputs lead the step's outputs. A request
        that started runs on: dropping it would throw its work away."""
        heap = self._start_deadlines
        sched = self.scheduler
        due = []
        while heap and heap[0][0] <= now_s:
            _, request_id = heapq.heappop(heap)
            request = sched.get_request(request_id)
            if request is None or not _untouched(request):
                continue
            leader = sched.get_request(request.prefix_leader_id or "")
            if leader is None or _untouched(leader):
                due.append(request_id)
        if not due:
            return []
        return self.finish_requests(due, FinishReason.ABORT, START_DEADLINE_MISSED)

    def _charge(self, tokens_by_tenant: dict[str, int], step_s: float) -> None:
        """Add one step's wall time to `busy_s` and the tenants' shares (see the module doc)."""
        if not tokens_by_tenant:
            return
        self.busy_s += step_s
        for tenant_id, share_s in split_step_time(tokens_by_tenant, step_s).items():
            self.tenant_busy_s[tenant_id] = self.tenant_busy_s.get(tenant_id, 0.0) + share_s
        for tenant_id, num_tokens in tokens_by_tenant.items():
            count = self.tenant_scheduled_tokens.get(tenant_id, 0)
            self.tenant_scheduled_tokens[tenant_id] = count + num_tokens


def _untouched(request: Request) -> bool:
    """Waiting with nothing computed and nothing generated (never started)."""
    return (
        request.status is RequestStatus.WAITING
        and request.num_computed_tokens == 0
        and request.num_output_tokens == 0
    )
