"""`SchedulerState`: everything the scheduler knows between steps, in one object, and the
plain functions over it: the request lifecycle (add, release, finish), the per-request rules
(validation, stop checks, the engine output of a step), applying a computed step, and the
read-only views.

A `Scheduler` owns one state; the scheduling decisions (`sits.sched.planner`) and the
functions here take it explicitly. The per-request functions are pure functions of a request
and the config; the read-only views change nothing (their `now_s` is on the time.monotonic()
clock) and `Scheduler` exposes them as methods of the same names.

Applying a step: `apply_step_result`, and with async scheduling `apply_step_ahead`, which
applies a launched step before its tokens are known. Async scheduling
(`EngineConfig.async_scheduling`): the engine plans step N+1 while the device still runs step
N. `apply_step_ahead` (`Scheduler.update_ahead`) applies step N as far as it can without N's
tokens: each scheduled request's computed tokens advance, the blocks it fills enter the prefix
cache, and each sampled request gets `PLACEHOLDER_TOKEN_ID` as its newest output token, so the
next plan schedules it one decode further (its input id is filled in on the device from step
N's sampled tokens, see `ModelRunner.launch`). `apply_step_result` (`Scheduler.update`) then
replaces the placeholder with the real token, checks the stop conditions and reports.

Invariants:
- A request is in exactly one of: its tenant's waiting queue, the running list, or finished
  (dropped from `requests`, `arrival_seq` and `num_prompt_charged`, which hold exactly the
  unfinished requests). A finished request may stay in `running` until `drop_finished`, and
  then `running_finished` is True.
- Running requests hold KV blocks for all their computed tokens; waiting ones hold no device
  blocks (a swapped-out one holds host blocks, `SwapPlanner`).
- `known_to_runner` holds the unfinished requests sent in a `StepPlan.new_requests`;
  `finished_ids` those of them finished since the last plan (the next plan carries them).
- At most one step is ahead: when `apply_step_ahead` runs, every earlier placeholder is
  resolved, so a placeholder is always a request's last token.
- A request that will surely end with step N (a length limit reached, or a prompt-only request
  whose prompt is done) is not planned again: its id is in `state.ahead_done`, which
  `planner.plan_step` skips. A request that ends on a stop token or EOS sampled in step N
  cannot be known ahead: it runs one more decode in step N+1, whose token is dropped.
- Blocks enter the prefix cache once their tokens are known and their KV is computed or queued
  (a later step that reads them runs after the step that writes them, on one device stream).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sits.core.errors import InvalidParameterError
from sits.core.limits import resolve_limits
from sits.core.outputs import EngineCoreOutput, TokenLogprobs
from sits.core.plan import PLACEHOLDER_TOKEN_ID, ScheduledRequest, StepPlan, StepResult
from sits.core.request import FinishReason, Request, RequestStatus
from sits.kvcache.kv_manager import KVCacheManager
from sits.sched.config import SchedulerConfig, TenantTier
from sits.sched.swap import SwapPlanner
from sits.sched.tenants import TenantBook, TenantState


@dataclass(slots=True)
class SchedulerState:
    """The scheduler's state between steps (see the module docstring for its invariants).

    Attributes:
        config: step limits, KV cache geometry and tenant policies.
        swapper: the host KV tier's bookkeeping (swap or recompute, host prefix cache).
        kv: the device KV cache manager (block tables, prefix cache).
        book: per-tenant queues, usage, reservations and virtual counters.
        requests: unfinished requests by id.
        arrival_seq: request id -> add order, the tie-break of equal arrival times.
        next_arrival_seq: the add order the next request gets.
        num_prompt_charged: request id -> prompt tokens its tenant was charged (VTC).
        running: running requests in admission order.
        known_to_runner: ids sent in `StepPlan.new_requests` and not finished.
        finished_ids: finished since the last plan, among those the runner knew.
        running_finished: a finished request is still in `running`.
        num_preemptions: preemptions so far (cumulative).
        ahead_plan: the step `apply_step_ahead` applied, not yet updated.
        ahead_done: its requests that end with it (not scheduled again).
        last_tokens_by_tenant: tokens the last plan scheduled, per request tenant id.
    """

    config: SchedulerConfig
    swapper: SwapPlanner
    kv: KVCacheManager
    book: TenantBook
    requests: dict[str, Request] = field(default_factory=dict)
    arrival_seq: dict[str, int] = field(default_factory=dict)
    next_arrival_seq: int = 0
    num_prompt_charged: dict[str, int] = field(default_factory=dict)
    running: list[Request] = field(default_factory=list)
    known_to_runner: set[str] = field(default_factory=set)
    finished_ids: list[str] = field(default_factory=list)
    running_finished: bool = False
    num_preemptions: int = 0
    ahead_plan: StepPlan | None = None
    ahead_done: set[str] = field(default_factory=set)
    last_tokens_by_tenant: dict[str, int] = field(default_factory=dict)


def new_state(config: SchedulerConfig) -> SchedulerState:
    """An empty state for `config`: no requests, every block free."""
    swapper = SwapPlanner(config)
    kv = KVCacheManager(
        config.num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        host_tier=swapper.prefix_tier,
    )
    return SchedulerState(config=config, swapper=swapper, kv=kv, book=TenantBook(config))


def add_request(state: SchedulerState, request: Request) -> None:
    """Queue a new request (status WAITING) in its tenant's waiting queue.

    Raises:
        InvalidParameterError: a request id already in use ("request_id"), or what
            `validate_request` and `TenantBook.tenant_of` raise.
        PromptTooLongError: from `validate_request`.
    """
    request_id = request.request_id
    if request_id in state.requests:
        raise InvalidParameterError("request_id", f"request id {request_id!r} is already in use")
    validate_request(request, state.config)
    tenant = state.book.tenant_of(request)
    request.status = RequestStatus.WAITING
    request.num_computed_tokens = 0
    state.requests[request_id] = request
    state.arrival_seq[request_id] = state.next_arrival_seq
    state.next_arrival_seq += 1
    state.num_prompt_charged[request_id] = 0
    state.book.push_waiting(tenant, request, state.arrival_seq[request_id])


def release(state: SchedulerState, request: Request, tenant: TenantState) -> None:
    """Free a running request's device blocks and its tenant's slot."""
    block_ids = list(state.kv.get_block_ids(request.request_id))
    state.kv.free(request)
    state.book.stop_running(tenant, block_ids)


def finish_request(
    state: SchedulerState, request: Request, reason: FinishReason, stop_reason: int | str | None
) -> None:
    """Mark an unfinished request finished and free its blocks; `drop_finished` removes it
    from the running list (a waiting request leaves its queue here)."""
    tenant = state.book.tenant_of(request)
    if request.status is RequestStatus.RUNNING:
        release(state, request, tenant)
        state.running_finished = True
    else:
        state.kv.free(request)  # holds no blocks, but drops its cached hashes
        state.book.remove_waiting(tenant, request)
        if state.swapper.enabled:
            state.swapper.drop(request.request_id)
    request.status = RequestStatus.FINISHED
    request.finish_reason = reason
    request.stop_reason = stop_reason
    request_id = request.request_id
    del state.requests[request_id]
    del state.arrival_seq[request_id]
    del state.num_prompt_charged[request_id]
    if request_id in state.known_to_runner:
        state.known_to_runner.remove(request_id)
        state.finished_ids.append(request_id)


def drop_finished(state: SchedulerState) -> None:
    """Remove finished requests from the running list (after `finish_request`)."""
    if state.running_finished:
        state.running = [r for r in state.running if not r.is_finished]
        state.running_finished = False


def finish_requests(
    state: SchedulerState,
    request_ids: list[str],
    reason: FinishReason,
    stop_reason: int | str | None,
) -> list[EngineCoreOutput]:
    """End requests from outside (abort, stop string); unknown or finished ids are ignored.

    Returns:
        One finished `EngineCoreOutput` (no new tokens) per request actually ended.
    """
    outputs = []
    for request_id in request_ids:
        request = state.requests.get(request_id)
        if request is None:
            continue
        finish_request(state, request, reason, stop_reason)
        outputs.append(engine_output(request, [], None, None))
    drop_finished(state)
    return outputs


# -------------------------------------------------------------------------- per-request rules
def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """Stop check after a token was appended to `request`.

    Order: a stop token id, then EOS (unless `ignore_eos`) -- both only once
    `num_output_tokens >= min_tokens` -- then the length limits (`max_tokens` outputs or
    `max_model_len` tokens in all).

    Returns:
        (FinishReason.STOP, the stop token id) for a stop token, (STOP, None) for EOS,
        (LENGTH, None) at a limit, or None to keep going.
    """
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    token_id = output_token_ids[-1]
    num_output_tokens = len(output_token_ids)  # the properties, read once (every decode, step)
    if num_output_tokens >= params.min_tokens:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if not params.ignore_eos and token_id == request.eos_token_id:
            return FinishReason.STOP, None
    if reaches_length_limit(request, max_model_len):
        return FinishReason.LENGTH, None
    return None


def reaches_length_limit(request: Request, max_model_len: int) -> bool:
    """True when the request has `max_tokens` outputs or `max_model_len` tokens in all (its
    last token, possibly a placeholder of async scheduling, counted)."""
    return (
        len(request.output_token_ids) >= request.max_tokens
        or len(request.all_token_ids) >= max_model_len
    )


def validate_request(request: Request, config: SchedulerConfig) -> None:
    """Refuse a request that is malformed or could never run under `config` (its context and
    whole KV cache, `sits.core.limits.resolve_limits`: the engine's one check of a request).

    Raises:
        InvalidParameterError: empty prompt ("prompt").
        PromptTooLongError: prompt + max_tokens exceeds max_model_len, or needs more KV blocks
            than the whole cache holds.
    """
    resolve_limits(
        request.num_prompt_tokens,
        request.max_tokens,
        config.max_model_len,
        num_kv_blocks=config.num_usable_blocks,
        block_size=config.block_size,
    )


def engine_output(
    request: Request,
    new_token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
    prompt_logprobs: list[TokenLogprobs | None] | None,
) -> EngineCoreOutput:
    """What one step (or a finish from outside) produced for `request`.

    Built for every request in every step, so with positional arguments (half the cost of
    keywords here), in `EngineCoreOutput`'s field order.
    """
    num_cached_tokens = request.num_cached_tokens
    return EngineCoreOutput(
        request.request_id,
        new_token_ids,
        logprobs,  # new_logprobs
        prompt_logprobs,  # new_prompt_logprobs
        request.finish_reason,
        request.stop_reason,
        num_cached_tokens if num_cached_tokens > 0 else 0,
    )


def is_decode(request: Request) -> bool:
    """True when the request's next work is one decode token (not a prompt chunk/recompute)."""
    return bool(request.output_token_ids) and request.num_tokens - request.num_computed_tokens == 1


# ---------------------------------------------------------------------------- applying a step
def apply_step_ahead(state: SchedulerState, plan: StepPlan) -> None:
    """Async scheduling: apply a launched step before its tokens are known, so that the next
    `plan_step` can plan the step after it; `apply_step_result(state, plan, result)` completes
    it. At most one step may be ahead (see the module docstring)."""
    assert state.ahead_plan is None, "a step is already ahead"
    done: set[str] = set()
    max_model_len = state.config.max_model_len
    for scheduled in plan.scheduled:
        request = state.requests.get(scheduled.request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            continue
        request.num_computed_tokens += len(scheduled.token_ids)
        state.kv.cache_full_blocks(request, request.num_computed_tokens)
        if scheduled.sample:
            request.append_output_token(PLACEHOLDER_TOKEN_ID)
            if reaches_length_limit(request, max_model_len):
                done.add(request.request_id)
        elif request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
            done.add(request.request_id)
    state.ahead_plan, state.ahead_done = plan, done


def apply_step_result(
    state: SchedulerState, plan: StepPlan, result: StepResult
) -> list[EngineCoreOutput]:
    """Apply a computed step: advance computed tokens, cache blocks, append and stop.

    Requests finished between `plan_step` and this call (aborted) are skipped. Finished
    requests free their blocks at once. For the step `apply_step_ahead` applied, the computed
    tokens are advanced already and each sampled token replaces its placeholder; a request
    preempted since (waiting again) still gets its token and its stop check.

    Returns:
        One output per scheduled request that got a token, logprobs or prompt logprobs, or
        finished, in plan order.

    Raises:
        KeyError: the result lacks a sampled token for a request with `sample=True`.
    """
    ahead = plan is state.ahead_plan
    if ahead:
        state.ahead_plan, state.ahead_done = None, set()
    outputs = []
    requests = state.requests
    for scheduled in plan.scheduled:
        request = requests.get(scheduled.request_id)
        if request is None:
            continue
        # Not running: skipped, unless preempted by the plan made while this (ahead) step
        # ran: such a request still gets its token.
        if request.status is not RequestStatus.RUNNING and not (ahead and not request.is_finished):
            continue
        output = _update_request(state, request, scheduled, result, ahead)
        if output is not None:
            outputs.append(output)
    drop_finished(state)
    return outputs


def _update_request(
    state: SchedulerState,
    request: Request,
    scheduled: ScheduledRequest,
    result: StepResult,
    ahead: bool,
) -> EngineCoreOutput | None:
    """Apply one scheduled request's step (runs for every scheduled request); `ahead`:
    `apply_step_ahead` advanced its computed tokens and cached its blocks already."""
    request_id = request.request_id
    if not ahead:
        request.num_computed_tokens += len(scheduled.token_ids)
        assert request.num_computed_tokens <= len(request.all_token_ids), request
        state.kv.cache_full_blocks(request, request.num_computed_tokens)
    prompt_logprobs = result.prompt_logprobs.get(request_id) if result.prompt_logprobs else None
    if scheduled.sample:
        token_id = result.sampled_token_ids[request_id]
        if ahead:  # the newest output token is the step's placeholder
            assert request.output_token_ids[-1] == PLACEHOLDER_TOKEN_ID, request
            request.output_token_ids[-1] = request.all_token_ids[-1] = token_id
        else:
            request.append_output_token(token_id)
        logprobs_by_id = result.logprobs
        logprobs = [logprobs_by_id[request_id]] if request_id in logprobs_by_id else None
        finish = check_stop(request, state.config.max_model_len)
        if finish is None and result.grammar_ended and request_id in result.grammar_ended:
            finish = FinishReason.STOP, None  # its structured output is complete
        if finish is not None:
            finish_request(state, request, *finish)
        return engine_output(request, [token_id], logprobs, prompt_logprobs)
    if request.max_tokens == 0 and request.num_computed_tokens == len(request.all_token_ids):
        # A prompt-only request (e.g. prompt logprobs) ends once its prompt is computed.
        finish_request(state, request, FinishReason.LENGTH, None)
    elif prompt_logprobs is None:
        return None  # a prompt chunk with nothing to report
    return engine_output(request, [], None, prompt_logprobs)


# ---------------------------------------------------------------------------- read-only views
def waiting_request_ids(state: SchedulerState) -> list[str]:
    """Waiting request ids in service order: tenants by `tenant_order_key` as they stand now,
    each tenant's queue front first (without tenants: the FCFS queue)."""
    return [r.request_id for t in state.book.backlogged() for r in t.queue]


def queued_prefill(state: SchedulerState) -> dict[str, tuple[float | None, int]]:
    """Request tenant id -> (arrival_time of its oldest waiting request, or None when none
    waits; tokens still to prefill: every token of its waiting requests plus the prompt
    tokens its running requests have not computed), for tenant ids with any.
    O(running requests + tenant ids): the queues keep their load (`WaitingQueue.load`),
    and the stats snapshot calls this every step under load (it was a pass over every
    queued request: 1.5 ms per step with 3,000 queued on the H200's host)."""
    oldest: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for tenant in state.book.tenants.values():  # a tenant id's requests wait in one queue
        for tenant_id, (arrival_s, num_tokens) in tenant.queue.load().items():
            oldest[tenant_id] = arrival_s
            tokens[tenant_id] = num_tokens
    for request in state.running:
        left = len(request.prompt_token_ids) - request.num_computed_tokens
        if left > 0:
            tokens[request.tenant_id] = tokens.get(request.tenant_id, 0) + left
    return {tenant_id: (oldest.get(tenant_id), n) for tenant_id, n in tokens.items()}


def prompt_tokens_at_risk(
    state: SchedulerState, now_s: float, slack_fraction: float, tenant_ids: Iterable[str]
) -> int:
    """Prompt tokens still to compute of the requests of `tenant_ids` whose first token is at
    risk: no output token yet, and at most `slack_fraction` x the tenant's TTFT SLO left
    before arrival_time + TTFT (`now_s` on the same time.monotonic() clock). Tenants without
    a TTFT SLO add nothing. O(those tenants' waiting requests + running)."""
    total = 0
    ttft_s_of = {}
    for tenant_id in tenant_ids:
        tenant = state.book.tenants.get(tenant_id)
        if tenant is None or tenant.policy.ttft_ms is None:
            continue
        ttft_s = ttft_s_of[tenant_id] = tenant.policy.ttft_ms / 1000
        latest_arrival_s = now_s - (1 - slack_fraction) * ttft_s
        for request in tenant.queue:
            if request.num_output_tokens == 0 and request.arrival_time <= latest_arrival_s:
                total += request.num_prompt_tokens - request.num_computed_tokens
    for request in state.running:
        ttft_s = ttft_s_of.get(request.tenant_id)
        if ttft_s is None or request.num_output_tokens > 0:
            continue
        if request.arrival_time <= now_s - (1 - slack_fraction) * ttft_s:
            total += max(request.num_prompt_tokens - request.num_computed_tokens, 0)
    return total


def reclaim_due_tenants(
    state: SchedulerState, now_s: float, patience_fraction: float
) -> frozenset[str]:
    """Guaranteed tenants with waiting work whose reservation may be reclaimed from borrowers
    by preemption now (`planner.plan_step`'s `reclaim_tenants`): those without a TTFT SLO,
    and those whose oldest waiting request arrived at least `patience_fraction` x their TTFT
    SLO before `now_s` (time.monotonic()). Until then their protected slots and blocks take
    what finishing requests free, with no work thrown away. O(tenants) amortized
    (`WaitingQueue.load`)."""
    due = []
    for tenant in state.book.tenants.values():
        policy = tenant.policy
        if policy.tier is not TenantTier.GUARANTEED or not len(tenant.queue):
            continue
        if policy.ttft_ms is None:
            due.append(policy.tenant_id)
            continue
        oldest_s = min(arrival_s for arrival_s, _ in tenant.queue.load().values())
        if now_s - oldest_s >= patience_fraction * policy.ttft_ms / 1000:
            due.append(policy.tenant_id)
    return frozenset(due)
