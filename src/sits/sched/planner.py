"""`plan_step`: one step's scheduling decisions over a `SchedulerState`, as a `StepPlan`.

One rule drives every step (as in vLLM v1): each request's computed tokens catch up with its
total tokens (prompt + outputs), a prefill chunk or a decode alike, within
`max_num_batched_tokens`. A step has three phases:
1. reclaim (tenant-aware mode only): a guaranteed tenant whose waiting work needs its unused
   reservation while borrowers hold it preempts those borrowers (recompute or swap), so it
   gets its reservation back in the step it asks for it; the caller may hold a tenant's
   reclaim back (`reclaim_tenants`: the engine waits until its oldest waiting request has
   used part of its TTFT SLO, `state.reclaim_due_tenants`), since the slots and blocks that
   finishing requests free go to its protected reservation first, at no recompute cost;
2. running requests, in admission order (tenant-aware: tenants within their reservation
   first, then by tier and priority, `tenants.running_order_key`); a request that cannot get
   blocks preempts victims (`tenants.victim_key`) until it fits or is itself the victim;
3. waiting requests, one at a time in the policy's order (`TenantBook.backlogged`, each
   tenant's `WaitingQueue`: FCFS without tenants; tier, priority, virtual token counter and
   EDF with tenants), while the budget, the sequence slots and the blocks each tenant may
   take (`tenants.TenantBook`) allow.

Preemption swaps or recomputes: with a host tier (`config.num_host_blocks`), a victim whose
computed blocks fit in the free host blocks and whose copy out and back is cheaper than
recomputing its tokens (`SwapCostModel`) is swapped: the plan carries (device, host) copies in
`swap_out`, the request keeps `num_computed_tokens` while waiting, and when admitted again it
gets new device blocks filled by `swap_in` copies and goes on without recompute. Otherwise it
drops its KV and recomputes (`num_computed_tokens = 0`). With prefix caching, the host tier
also keeps prefix blocks the device evicts, and a prefix hit there is copied back in
(`swap_out`/`swap_in` too) instead of recomputed (`sits.kvcache.host_prefix`).

Without configured tenants this is plain FCFS: a preempted request goes to the front of the
queue, a request that does not fit stops admission (no later one jumps ahead), and the victim
is the latest-arrived running request not yet scheduled in the step.

Invariants:
- Every decision is a pure function of the state (no clocks, no randomness), so the same
  inputs give the same plans (identical across TP ranks, testable exactly on CPU).
- A step's scheduled tokens sum to at most `max_num_batched_tokens`, its prompt chunks and
  recomputes to at most `max_prefill_tokens` (TPOT pacing; decodes are never limited); a
  request sampled in a step is one whose computed tokens reach all its tokens.
- After a step that preempted, or once a waiting request did not fit, only admissions within
  the admitted tenant's own reservation happen in that step (nobody borrows past it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sits.core.plan import NewRequestData, ScheduledRequest, StepPlan
from sits.core.request import Request, RequestStatus
from sits.kvcache.kv_manager import NO_HIT, PrefixHit
from sits.sched.config import TenantTier
from sits.sched.state import SchedulerState, is_decode, release
from sits.sched.tenants import TenantState, running_order_key, victim_key


@dataclass(slots=True)
class StepState:
    """What one `plan_step` call has decided so far."""

    token_budget: int
    prefill_budget: int  # tokens left for prompt chunks and recomputes (decodes not counted)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    new_requests: list[NewRequestData] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) block ids
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) block ids
    num_preempted: int = 0
    deferred_ids: set[str] = field(default_factory=set)  # siblings waiting for their leader
    blocked_tenant_ids: set[str] = field(default_factory=set)  # next request did not fit
    tokens_by_tenant: dict[str, int] = field(default_factory=dict)  # scheduled, per tenant id


def plan_step(
    state: SchedulerState,
    max_prefill_tokens: int | None = None,
    reclaim_tenants: frozenset[str] | None = None,
) -> StepPlan:
    """Decide this step's work: reclaim reservations, running requests, then waiting ones.

    Args:
        state: the scheduler's state; updated with the step's admissions, preemptions and
            allocations (`last_tokens_by_tenant` too).
        max_prefill_tokens: at most this many prompt/recompute tokens in the step (TPOT
            pacing, `sits.sched.step_policy`); decodes are not limited. None: the budget.
        reclaim_tenants: the guaranteed tenants that may preempt borrowers to get their
            reservation back in this step; None: all of them.

    Returns:
        The plan: scheduled requests in batch order, requests new to the runner, and the
        ids of requests finished since the last call that the runner had been sent.
    """
    swapper = state.swapper
    if swapper.enabled:  # no host tier: no host blocks to unpin or free
        swapper.begin_step()
    budget = state.config.max_num_batched_tokens
    prefill_budget = budget if max_prefill_tokens is None else min(max_prefill_tokens, budget)
    step = StepState(token_budget=budget, prefill_budget=max(prefill_budget, 0))
    if state.book.fair:
        _reclaim_reservations(state, step, reclaim_tenants)
    _schedule_running(state, step)
    _schedule_waiting(state, step)
    if swapper.enabled:
        swapper.end_step(step.swap_out, step.swap_in)
    state.last_tokens_by_tenant = step.tokens_by_tenant
    finished_ids, state.finished_ids = state.finished_ids, []
    return StepPlan(
        scheduled=step.scheduled,
        new_requests=step.new_requests,
        finished_request_ids=finished_ids,
        swap_out=step.swap_out,
        swap_in=step.swap_in,
    )


def _reclaim_reservations(
    state: SchedulerState, step: StepState, tenant_ids: frozenset[str] | None
) -> None:
    """Guaranteed tenants with waiting work (of `tenant_ids`; None: all) take back reserved
    blocks/slots from borrowers.

    Victims are running requests of OTHER tenants holding more blocks (resp. slots) than
    their own reservation, largest `victim_key` first, until the guaranteed tenant's
    protected need is free for it or no such borrower is left.
    """
    book = state.book
    for g in book.backlogged():
        if g.policy.tier is not TenantTier.GUARANTEED:
            continue
        if tenant_ids is not None and g.policy.tenant_id not in tenant_ids:
            continue
        while book.block_shortfall(g, state.kv.num_free_blocks) > 0:
            if not _preempt_one(
                state, step, lambda t, g=g: t is not g and t.blocks_used > t.reserved_blocks
            ):
                break
        while book.seq_shortfall(g) > 0:
            if not _preempt_one(
                state, step, lambda t, g=g: t is not g and t.num_running > t.reserved_seqs
            ):
                break


def _preempt_one(
    state: SchedulerState, step: StepState, among: Callable[[TenantState], bool]
) -> bool:
    """Preempt the best victim whose tenant satisfies `among`; False if there is none."""
    victim = _pick_victim(state, step, among)
    if victim is None:
        return False
    _preempt(state, victim, step)
    step.num_preempted += 1
    return True


def _schedule_running(state: SchedulerState, step: StepState) -> None:
    """Schedule the running requests in order (phase 2 of the module docstring).

    This loop runs for every running request in every step (256 decodes: about a third of
    the step's host time), so it reads the request's fields directly, and a request whose
    held blocks already have room for its new tokens (most decode steps) skips
    `_allocate_or_preempt` when its tenant may take 0 blocks: exactly what that call's first
    `_try_allocate` would answer, with nothing changed.
    """
    book = state.book
    if book.fair:  # one key per tenant (keys do not change while sorting)
        keys = {t.tenant_id: running_order_key(t) for t in book.tenants.values()}
        running = sorted(state.running, key=lambda r: keys[r.tenant_id])
    else:
        running = list(state.running)  # a copy: a preemption removes from the list
    kv = state.kv
    block_size = state.config.block_size
    num_free_blocks = kv.num_free_blocks  # changes only in `_allocate_or_preempt`
    ahead_done = state.ahead_done
    for request in running:
        if step.token_budget == 0:
            return
        if request.status is not RequestStatus.RUNNING:
            continue  # preempted earlier in this step
        if ahead_done and request.request_id in ahead_done:
            continue  # ends with the step on the device (async scheduling)
        num_left = len(request.all_token_ids) - request.num_computed_tokens
        decode = num_left == 1 and bool(request.output_token_ids)  # `is_decode`, inlined
        num_new_tokens = min(num_left, step.token_budget)
        if not decode:
            num_new_tokens = min(num_new_tokens, step.prefill_budget)
            if num_new_tokens == 0:
                continue  # paced: its prompt goes on in a later step
        assert num_new_tokens >= 1, request
        tenant = book.tenant_of(request)
        num_held = len(kv.get_block_ids(request.request_id))
        in_place = request.num_computed_tokens + num_new_tokens <= num_held * block_size
        if not (in_place and book.may_take_blocks(tenant, 0, num_free_blocks, False)):
            allocated = _allocate_or_preempt(state, request, tenant, num_new_tokens, step)
            num_free_blocks = kv.num_free_blocks
            if not allocated:
                continue  # it was preempted itself
        _add_to_step(state, request, tenant, num_new_tokens, step, decode)


def _allocate_or_preempt(
    state: SchedulerState,
    request: Request,
    tenant: TenantState,
    num_new_tokens: int,
    step: StepState,
) -> bool:
    """Get blocks for a running request, preempting victims until it fits.

    Victims come from tenants holding blocks beyond their reservation and the request's own
    tenant (so the request itself is always a candidate), largest `victim_key` first.

    Returns:
        True when allocated; False when the request itself was preempted.
    """
    while not _try_allocate(state, request, tenant, num_new_tokens, NO_HIT, False):
        # Victims: block borrowers, or the requester's own tenant (never another tenant
        # within its reserved blocks).
        victim = _pick_victim(
            state, step, lambda t: t is tenant or t.blocks_used > t.reserved_blocks
        )
        assert victim is not None, "the request asking for blocks is always a candidate"
        _preempt(state, victim, step)
        step.num_preempted += 1
        if victim is request:
            return False
    return True


def _try_allocate(
    state: SchedulerState,
    request: Request,
    tenant: TenantState,
    num_new_tokens: int,
    hit: PrefixHit,
    within_reservation: bool,
    count_lookup: bool = True,
) -> bool:
    """Allocate the request's blocks if its tenant may take them now; False: unchanged."""
    kv, book = state.kv, state.book
    free = kv.num_free_blocks
    num_held = len(kv.get_block_ids(request.request_id))
    total = request.num_computed_tokens + num_new_tokens
    if not hit.block_ids and total <= num_held * state.config.block_size:
        # Its blocks hold the new tokens already (most decode steps): nothing to take.
        return book.may_take_blocks(tenant, 0, free, within_reservation)
    num_blocks = kv.num_blocks_to_take(request, num_new_tokens, hit)
    if not book.may_take_blocks(tenant, num_blocks, free, within_reservation):
        return False
    allocated = kv.allocate_slots(request, num_new_tokens, hit, count_lookup)
    assert allocated, (request.request_id, num_blocks, free)
    book.add_blocks(tenant, kv.get_block_ids(request.request_id)[num_held:])
    return True


def _pick_victim(
    state: SchedulerState, step: StepState, among: Callable[[TenantState], bool]
) -> Request | None:
    """The running request not scheduled in this step, of a tenant satisfying `among`, with
    the largest `victim_key`; None if there is none."""
    tenant_of = state.book.tenant_of
    candidates = [
        r for r in state.running if r.request_id not in step.scheduled_ids and among(tenant_of(r))
    ]
    if not candidates:
        return None
    fair = state.book.fair
    arrival_seq = state.arrival_seq
    return max(
        candidates,
        key=lambda r: victim_key(r, tenant_of(r), arrival_seq[r.request_id], fair),
    )


def _preempt(state: SchedulerState, request: Request, step: StepState) -> None:
    """Preempt a running request: swap its blocks to the host tier when that is cheaper than
    recomputing and the tier has room (`SwapPlanner.swap_out`), else drop its KV. Either way
    it keeps its outputs, frees its device blocks and goes back to its tenant's queue (FCFS:
    its front)."""
    tenant = state.book.tenant_of(request)
    copies = state.swapper.swap_out(request, state.kv.get_block_ids(request.request_id))
    if copies is None:
        request.num_computed_tokens = 0
    else:
        step.swap_out.extend(copies)
    release(state, request, tenant)
    request.status = RequestStatus.WAITING
    request.num_preemptions += 1
    state.num_preemptions += 1
    tenant.num_preemptions += 1
    state.running.remove(request)
    arrival_seq = state.arrival_seq[request.request_id]
    state.book.push_waiting(tenant, request, arrival_seq, preempted=True)


def _schedule_waiting(state: SchedulerState, step: StepState) -> None:
    """Admit waiting requests in policy order while the budget and capacity allow.

    A tenant whose next request does not fit is done for the step, and from then on (as
    after any preemption) others may only take capacity within their reservation, unless it
    failed only because its tier may not borrow (`set_borrowing_tiers`).
    """
    closed = step.num_preempted > 0  # short of blocks: borrowing would only thrash
    while min(step.token_budget, step.prefill_budget) > 0:
        picked = _next_waiting(state, step)
        if picked is None:
            return
        tenant, request = picked
        if _waits_for_leader(state, request):
            step.deferred_ids.add(request.request_id)
        elif not _admit(state, request, tenant, step, closed):
            step.blocked_tenant_ids.add(tenant.tenant_id)
            # A real shortage (not a tenant barred from borrowing) stops borrowing.
            closed = closed or state.book.may_borrow(tenant)


def _next_waiting(state: SchedulerState, step: StepState) -> tuple[TenantState, Request] | None:
    """The next waiting request to try: first tenant in order, its first request."""
    for tenant in state.book.backlogged():
        if tenant.tenant_id in step.blocked_tenant_ids:
            continue
        for request in tenant.queue:
            if request.request_id not in step.deferred_ids:
                return tenant, request
    return None


def _waits_for_leader(state: SchedulerState, request: Request) -> bool:
    """True while the request's prefix leader is alive and has not computed its prompt."""
    if request.prefix_leader_id is None:
        return False
    leader = state.requests.get(request.prefix_leader_id)
    if leader is None or leader.is_finished:
        return False
    return leader.num_computed_tokens < leader.num_prompt_tokens


def _admit(
    state: SchedulerState, request: Request, tenant: TenantState, step: StepState, closed: bool
) -> bool:
    """Move a waiting request to running with its prefix hits; False if it may not."""
    book, kv, swapper = state.book, state.kv, state.swapper
    within_reservation = closed or not book.may_borrow(tenant)
    if not book.may_take_seq(tenant, within_reservation):
        return False
    swapped = swapper.enabled and swapper.is_swapped(request.request_id)
    if swapped:  # resumes with its own KV from the host tier: no prefix lookup
        hit, num_cached_tokens = NO_HIT, request.num_computed_tokens
    else:  # hits on the device, or on the host tier (copied in: computed tokens too)
        hit = kv.get_computed_blocks(request)
        num_cached_tokens = hit.num_tokens
    num_new_tokens = min(
        request.num_tokens - num_cached_tokens, step.token_budget, step.prefill_budget
    )
    if not _try_allocate(
        state, request, tenant, num_new_tokens, hit, within_reservation, not swapped
    ):
        return False
    book.remove_waiting(tenant, request)
    book.start_running(tenant)
    if swapped:
        block_ids = kv.get_block_ids(request.request_id)
        step.swap_in.extend(swapper.swap_in(request.request_id, block_ids))
    else:
        request.num_computed_tokens = num_cached_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached_tokens
    request.status = RequestStatus.RUNNING
    state.running.append(request)
    _add_to_step(state, request, tenant, num_new_tokens, step, is_decode(request))
    return True


def _add_to_step(
    state: SchedulerState,
    request: Request,
    tenant: TenantState,
    num_new_tokens: int,
    step: StepState,
    decode: bool,
) -> None:
    """Put the request's next `num_new_tokens` into the step (`decode`: `is_decode` of the
    request, which the callers know already). Runs for every scheduled request."""
    request_id = request.request_id
    all_token_ids = request.all_token_ids
    start = request.num_computed_tokens
    end = start + num_new_tokens
    sample = end == len(all_token_ids) and request.max_tokens > 0
    step.scheduled.append(
        ScheduledRequest.build(  # request_id, token_ids, start, block_ids, sample, outputs
            request_id,
            all_token_ids[start:end],
            start,
            state.kv.get_block_ids(request_id)[:],  # a copy: the table grows later
            sample,
            request.output_token_ids,
        )
    )
    step.scheduled_ids.add(request_id)
    if not decode:  # before _charge: `start` is its computed tokens now
        step.prefill_budget -= num_new_tokens
    step.token_budget -= num_new_tokens
    tenant_tokens = step.tokens_by_tenant
    tenant_id = request.tenant_id
    tenant_tokens[tenant_id] = tenant_tokens.get(tenant_id, 0) + num_new_tokens
    _charge(state, request, tenant, start, end, sample)
    if request_id not in state.known_to_runner:
        state.known_to_runner.add(request_id)
        step.new_requests.append(
            NewRequestData(
                request_id=request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
            )
        )


def _charge(
    state: SchedulerState, request: Request, tenant: TenantState, start: int, end: int, sample: bool
) -> None:
    """Charge the tenant for prompt tokens computed the first time and a sampled token.

    Prompt tokens served by the prefix cache or recomputed after a preemption are free.
    """
    charged = state.num_prompt_charged[request.request_id]
    num_prompt_tokens = len(request.prompt_token_ids)
    num_prompt = 0
    if charged < end and charged < num_prompt_tokens:  # prompt tokens not charged
        prompt_end = min(end, num_prompt_tokens)
        num_prompt = max(prompt_end - max(start, charged), 0)
        state.num_prompt_charged[request.request_id] = prompt_end
    state.book.charge(tenant, num_prompt, int(sample))
