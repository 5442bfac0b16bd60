"""`SchedulerState`: everything the scheduler knows between steps, in one object, and the
request lifecycle over it (add, release, finish).

A `Scheduler` owns one state; the scheduling decisions (`sits.sched.planner`), the step
updates (`sits.sched.update`) and the read-only views (`sits.sched.queries`) are plain
functions that take it explicitly. The functions here are the ones they share: queueing a
request, freeing a running request's blocks, and finishing a request.

Invariants:
- A request is in exactly one of: its tenant's waiting queue, the running list, or finished
  (dropped from `requests`, `arrival_seq` and `num_prompt_charged`, which hold exactly the
  unfinished requests). A finished request may stay in `running` until `drop_finished`, and
  then `running_finished` is True.
- Running requests hold KV blocks for all their computed tokens; waiting ones hold no device
  blocks (a swapped-out one holds host blocks, `SwapPlanner`).
- `known_to_runner` holds the unfinished requests sent in a `StepPlan.new_requests`;
  `finished_ids` those of them finished since the last plan (the next plan carries them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sits.core.errors import InvalidParameterError
from sits.core.outputs import EngineCoreOutput
from sits.core.plan import StepPlan
from sits.core.request import FinishReason, Request, RequestStatus
from sits.kvcache.kv_manager import KVCacheManager
from sits.sched.checks import engine_output, validate_request
from sits.sched.config import SchedulerConfig
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
        ahead_plan: the step `update.apply_step_ahead` applied, not yet updated.
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
