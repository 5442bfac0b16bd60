"""`Scheduler`: continuous batching under one token budget per step, with preemption.

One rule drives every step (as in vLLM v1): each request's computed tokens catch up with its
total tokens (prompt + outputs), a prefill chunk or a decode alike, within
`max_num_batched_tokens`. A step has three phases:
1. reclaim (tenant-aware mode only): a guaranteed tenant whose waiting work needs its unused
   reservation while borrowers hold it preempts those borrowers (recompute or swap), so it
   gets its reservation back in the step it asks for it; the caller may hold a tenant's
   reclaim back (`reclaim_tenants`: the engine waits until its oldest waiting request has
   used part of its TTFT SLO, `queries.reclaim_due_tenants`), since the slots and blocks that
   finishing requests free go to its protected reservation first, at no recompute cost;
2. running requests, in admission order (tenant-aware: tenants within their reservation
   first, then by tier and priority); a request that cannot get blocks preempts victims
   (`policy.victim_key`) until it fits or is itself the victim;
3. waiting requests, one at a time from `policy`'s order (FCFS without tenants; tier,
   priority, virtual token counter and EDF with tenants), while the budget, the sequence
   slots and the blocks each tenant may take (`tenants.TenantBook`) allow.

Preemption swaps or recomputes: with a host tier (`config.num_host_blocks`), a victim whose
computed blocks fit in the free host blocks and whose copy out and back is cheaper than
recomputing its tokens (`SwapCostModel`) is swapped: the plan carries (device, host) copies in
`swap_out`, the request keeps `num_computed_tokens` while waiting, and when admitted again it
gets new device blocks filled by `swap_in` copies and goes on without recompute. Otherwise it
drops its KV and recomputes (`num_computed_tokens = 0`). `swap_stats` counts both. With prefix
caching, the host tier also keeps prefix blocks the device evicts, and a prefix hit there is
copied back in (`swap_out`/`swap_in` too) instead of recomputed (`sits.kvcache.host_prefix`).

Without configured tenants this is plain FCFS: a preempted request goes to the front of the
queue, a request that does not fit stops admission (no later one jumps ahead), and the victim
is the latest-arrived running request not yet scheduled in the step.

Invariants:
- Every decision is a pure function of the scheduler's state (no clocks, no randomness), so the
  same inputs give the same plans (identical across TP ranks, testable exactly on CPU).
- A request is in exactly one of: its tenant's waiting queue, the running list, or finished
  (dropped).
- Running requests hold KV blocks for all their computed tokens; waiting ones hold no device
  blocks; a waiting request with computed tokens (swapped out) holds exactly
  cdiv(num_computed_tokens, block_size) host blocks, freed when it finishes or after the step
  whose plan swapped them back in (so no swap-out of that step can overwrite them first).
- Blocks of a step's tokens enter the prefix cache in `update`, after they are computed.
- A step's scheduled tokens sum to at most `max_num_batched_tokens`, its prompt chunks and
  recomputes to at most `schedule`'s `max_prefill_tokens` (TPOT pacing; decodes are never
  limited); a request sampled in a step is one whose computed tokens reach all its tokens.
- After a step that preempted, or once a waiting request did not fit, only admissions within
  the admitted tenant's own reservation happen in that step (nobody borrows past it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sits.core.errors import InvalidParameterError
from sits.core.outputs import EngineCoreOutput
from sits.core.plan import NewRequestData, ScheduledRequest, StepPlan
from sits.core.request import FinishReason, Request, RequestStatus
from sits.kvcache.kv_manager import NO_HIT, KVCacheManager, PrefixHit
from sits.sched.checks import engine_output, is_decode, validate_request
from sits.sched.config import SchedulerConfig, TenantTier
from sits.sched.policy import edf_key, running_order_key, victim_key
from sits.sched.queries import SchedulerQueries
from sits.sched.swap import SwapPlanner
from sits.sched.tenants import TenantBook, TenantState
from sits.sched.update import SchedulerUpdate


@dataclass(slots=True)
class _StepState:
    """What one `schedule()` call has decided so far."""

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


class Scheduler(SchedulerUpdate, SchedulerQueries):
    """Continuous-batching scheduler over a paged KV cache with prefix caching and tenants.

    Args:
        config: step limits, KV cache geometry and tenant policies (none: plain FCFS).

    Typical step: `plan = schedule()`; the runner computes it; `outputs = update(plan,
    result)`. Between steps, `add_request` and `finish_requests` (aborts, stop strings).
    `last_tokens_by_tenant`: tokens the last `schedule()` scheduled, per request tenant id.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.last_tokens_by_tenant: dict[str, int] = {}
        self.swapper = SwapPlanner(config)
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            host_tier=self.swapper.prefix_tier,
        )
        self._book = TenantBook(config)
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._arrival_seq: dict[str, int] = {}  # add order, the tie-break of arrival_time
        self._next_arrival_seq = 0
        self._num_prompt_charged: dict[str, int] = {}  # prompt tokens already charged (VTC)
        self._running: list[Request] = []
        self._known_to_runner: set[str] = set()  # sent in StepPlan.new_requests, not finished
        self._finished_ids: list[str] = []  # finished since the last schedule(), runner knew
        self._running_finished = False  # a finished request is still in _running
        self._num_preemptions = 0
        self._ahead_plan: StepPlan | None = None  # the step `update_ahead` applied, not updated
        self._ahead_done: set[str] = set()  # its requests that end with it (not scheduled)

    # ----------------------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING) in its tenant's waiting queue.

        Raises:
            InvalidParameterError: empty prompt ("prompt"), negative max_tokens, a request
                id already in use ("request_id"), or, with tenants configured, a tenant_id
                that is not one of them ("tenant_id").
            PromptTooLongError: prompt + max_tokens exceeds max_model_len, or needs more KV
                blocks than the whole cache holds (it could never run).
        """
        if request.request_id in self._requests:
            raise InvalidParameterError(
                "request_id", f"request id {request.request_id!r} is already in use"
            )
        validate_request(request, self.config)
        tenant = self._book.tenant_of(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request_id = request.request_id
        self._requests[request_id] = request
        self._arrival_seq[request_id] = self._next_arrival_seq
        self._next_arrival_seq += 1
        self._num_prompt_charged[request_id] = 0
        self._book.push_waiting(tenant, request, self._queue_key(request, tenant))

    def finish_requests(
        self,
        request_ids: str | list[str],
        reason: FinishReason,
        stop_reason: int | str | None = None,
    ) -> list[EngineCoreOutput]:
        """End requests from outside (abort, client disconnect, stop string); frees blocks.

        Unknown or already finished ids are ignored.

        Returns:
            One finished `EngineCoreOutput` (no new tokens) per request actually ended.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                continue
            self._finish(request, reason, stop_reason)
            outputs.append(engine_output(request, [], None, None))
        self._drop_finished()
        return outputs

    # ----------------------------------------------------------------------------- schedule
    def schedule(
        self,
        max_prefill_tokens: int | None = None,
        reclaim_tenants: frozenset[str] | None = None,
    ) -> StepPlan:
        """Decide this step's work: reclaim reservations, running requests, then waiting ones.

        Args:
            max_prefill_tokens: at most this many prompt/recompute tokens in the step (TPOT
                pacing, `sits.sched.pacing`); decodes are not limited. None: the budget.
            reclaim_tenants: the guaranteed tenants that may preempt borrowers to get their
                reservation back in this step; None: all of them.

        Returns:
            The plan: scheduled requests in batch order, requests new to the runner, and the
            ids of requests finished since the last call that the runner had been sent.
        """
        self.swapper.begin_step()
        budget = self.config.max_num_batched_tokens
        prefill_budget = budget if max_prefill_tokens is None else min(max_prefill_tokens, budget)
        step = _StepState(token_budget=budget, prefill_budget=max(prefill_budget, 0))
        if self._book.fair:
            self._reclaim_reservations(step, reclaim_tenants)
        self._schedule_running(step)
        self._schedule_waiting(step)
        self.swapper.end_step(step.swap_out, step.swap_in)
        self.last_tokens_by_tenant = step.tokens_by_tenant
        finished_ids, self._finished_ids = self._finished_ids, []
        return StepPlan(
            scheduled=step.scheduled,
            new_requests=step.new_requests,
            finished_request_ids=finished_ids,
            swap_out=step.swap_out,
            swap_in=step.swap_in,
        )

    def _reclaim_reservations(self, step: _StepState, tenant_ids: frozenset[str] | None) -> None:
        """Guaranteed tenants with waiting work (of `tenant_ids`; None: all) take back
        reserved blocks/slots from borrowers.

        Victims are running requests of OTHER tenants holding more blocks (resp. slots) than
        their own reservation, largest `victim_key` first, until the guaranteed tenant's
        protected need is free for it or no such borrower is left.
        """
        book = self._book
        for g in book.backlogged():
            if g.policy.tier is not TenantTier.GUARANTEED:
                continue
            if tenant_ids is not None and g.policy.tenant_id not in tenant_ids:
                continue
            while book.block_shortfall(g, self.kv.num_free_blocks) > 0:
                if not self._preempt_one(
                    step, lambda t, g=g: t is not g and t.blocks_used > t.reserved_blocks
                ):
                    break
            while book.seq_shortfall(g) > 0:
                if not self._preempt_one(
                    step, lambda t, g=g: t is not g and t.num_running > t.reserved_seqs
                ):
                    break

    def _preempt_one(self, step: _StepState, among: Callable[[TenantState], bool]) -> bool:
        """Preempt the best victim whose tenant satisfies `among`; False if there is none."""
        victim = self._pick_victim(step, among)
        if victim is None:
            return False
        self._preempt(victim, step)
        step.num_preempted += 1
        return True

    def _schedule_running(self, step: _StepState) -> None:
        """Schedule the running requests in order (phase 2 of the module docstring).

        This loop runs for every running request in every step (256 decodes: about a third of
        the step's host time), so it reads the request's fields directly, and a request whose
        held blocks already have room for its new tokens (most decode steps) skips
        `_allocate_or_preempt` when its tenant may take 0 blocks: exactly what that call's
        first `_try_allocate` would answer, with nothing changed.
        """
        book = self._book
        if book.fair:  # one key per tenant (keys do not change while sorting)
            keys = {t.tenant_id: running_order_key(t) for t in book.tenants.values()}
            running = sorted(self._running, key=lambda r: keys[r.tenant_id])
        else:
            running = list(self._running)  # a copy: a preemption removes from the list
        kv = self.kv
        block_size = self.config.block_size
        num_free_blocks = kv.num_free_blocks  # changes only in `_allocate_or_preempt`
        ahead_done = self._ahead_done
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
                allocated = self._allocate_or_preempt(request, tenant, num_new_tokens, step)
                num_free_blocks = kv.num_free_blocks
                if not allocated:
                    continue  # it was preempted itself
            self._add_to_step(request, tenant, num_new_tokens, step, decode)

    def _allocate_or_preempt(
        self, request: Request, tenant: TenantState, num_new_tokens: int, step: _StepState
    ) -> bool:
        """Get blocks for a running request, preempting victims until it fits.

        Victims come from tenants holding blocks beyond their reservation and the request's
        own tenant (so the request itself is always a candidate), largest `victim_key` first.

        Returns:
            True when allocated; False when the request itself was preempted.
        """
        while not self._try_allocate(request, tenant, num_new_tokens, NO_HIT, False):
            # Victims: block borrowers, or the requester's own tenant (never another tenant
            # within its reserved blocks).
            victim = self._pick_victim(
                step, lambda t: t is tenant or t.blocks_used > t.reserved_blocks
            )
            assert victim is not None, "the request asking for blocks is always a candidate"
            self._preempt(victim, step)
            step.num_preempted += 1
            if victim is request:
                return False
        return True

    def _try_allocate(
        self,
        request: Request,
        tenant: TenantState,
        num_new_tokens: int,
        hit: PrefixHit,
        within_reservation: bool,
        count_lookup: bool = True,
    ) -> bool:
        """Allocate the request's blocks if its tenant may take them now; False: unchanged."""
        free = self.kv.num_free_blocks
        num_held = len(self.kv.get_block_ids(request.request_id))
        total = request.num_computed_tokens + num_new_tokens
        if not hit.block_ids and total <= num_held * self.config.block_size:
            # Its blocks hold the new tokens already (most decode steps): nothing to take.
            return self._book.may_take_blocks(tenant, 0, free, within_reservation)
        num_blocks = self.kv.num_blocks_to_take(request, num_new_tokens, hit)
        if not self._book.may_take_blocks(tenant, num_blocks, free, within_reservation):
            return False
        allocated = self.kv.allocate_slots(request, num_new_tokens, hit, count_lookup)
        assert allocated, (request.request_id, num_blocks, free)
        self._book.add_blocks(tenant, self.kv.get_block_ids(request.request_id)[num_held:])
        return True

    def _pick_victim(
        self, step: _StepState, among: Callable[[TenantState], bool] | None = None
    ) -> Request | None:
        """The running request not scheduled in this step with the largest `victim_key`."""
        candidates = [
            r
            for r in self._running
            if r.request_id not in step.scheduled_ids and (among is None or among(self._tenant(r)))
        ]
        if not candidates:
            return None
        fair = self._book.fair
        return max(
            candidates,
            key=lambda r: victim_key(r, self._tenant(r), self._arrival_seq[r.request_id], fair),
        )

    def _preempt(self, request: Request, step: _StepState) -> None:
        """Preempt a running request: swap its blocks to the host tier when that is cheaper
        than recomputing and the tier has room (`SwapPlanner.swap_out`), else drop its KV.
        Either way it keeps its outputs, frees its device blocks and goes back to its
        tenant's queue (FCFS: its front)."""
        tenant = self._tenant(request)
        copies = self.swapper.swap_out(request, self.kv.get_block_ids(request.request_id))
        if copies is None:
            request.num_computed_tokens = 0
        else:
            step.swap_out.extend(copies)
        self._release(request, tenant)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1
        tenant.num_preemptions += 1
        self._running.remove(request)
        key = self._queue_key(request, tenant)
        self._book.push_waiting(tenant, request, key, preempted=True)

    def _release(self, request: Request, tenant: TenantState) -> None:
        """Free a running request's blocks and its tenant's slot."""
        block_ids = list(self.kv.get_block_ids(request.request_id))
        self.kv.free(request)
        self._book.stop_running(tenant, block_ids)

    def _schedule_waiting(self, step: _StepState) -> None:
        """Admit waiting requests in policy order while the budget and capacity allow.

        A tenant whose next request does not fit is done for the step, and from then on
        (as after any preemption) others may only take capacity within their reservation,
        unless it failed only because its tier may not borrow (`set_borrowing_tiers`).
        """
        closed = step.num_preempted > 0  # short of blocks: borrowing would only thrash
        while min(step.token_budget, step.prefill_budget) > 0:
            picked = self._next_waiting(step)
            if picked is None:
                return
            tenant, request = picked
            if self._waits_for_leader(request):
                step.deferred_ids.add(request.request_id)
            elif not self._admit(request, tenant, step, closed):
                step.blocked_tenant_ids.add(tenant.tenant_id)
                # A real shortage (not a tenant barred from borrowing) stops borrowing.
                closed = closed or self._book.may_borrow(tenant)

    def _next_waiting(self, step: _StepState) -> tuple[TenantState, Request] | None:
        """The next waiting request to try: first tenant in order, its first request."""
        for tenant in self._book.backlogged():
            if tenant.tenant_id in step.blocked_tenant_ids:
                continue
            for request in tenant.queue:
                if request.request_id not in step.deferred_ids:
                    return tenant, request
        return None

    def _waits_for_leader(self, request: Request) -> bool:
        """True while the request's prefix leader is alive and has not computed its prompt."""
        if request.prefix_leader_id is None:
            return False
        leader = self._requests.get(request.prefix_leader_id)
        if leader is None or leader.is_finished:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens

    def _admit(self, request: Request, tenant: TenantState, step: _StepState, closed: bool) -> bool:
        """Move a waiting request to running with its prefix hits; False if it may not."""
        within_reservation = closed or not self._book.may_borrow(tenant)
        if not self._book.may_take_seq(tenant, within_reservation):
            return False
        swapped = self.swapper.is_swapped(request.request_id)
        if swapped:  # resumes with its own KV from the host tier: no prefix lookup
            hit, num_cached_tokens = NO_HIT, request.num_computed_tokens
        else:  # hits on the device, or on the host tier (copied in: computed tokens too)
            hit = self.kv.get_computed_blocks(request)
            num_cached_tokens = hit.num_tokens
        num_new_tokens = min(
            request.num_tokens - num_cached_tokens, step.token_budget, step.prefill_budget
        )
        if not self._try_allocate(
            request, tenant, num_new_tokens, hit, within_reservation, not swapped
        ):
            return False
        self._book.remove_waiting(tenant, request)
        self._book.start_running(tenant)
        if swapped:
            block_ids = self.kv.get_block_ids(request.request_id)
            step.swap_in.extend(self.swapper.swap_in(request.request_id, block_ids))
        else:
            request.num_computed_tokens = num_cached_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        self._add_to_step(request, tenant, num_new_tokens, step, is_decode(request))
        return True

    def _add_to_step(
        self,
        request: Request,
        tenant: TenantState,
        num_new_tokens: int,
        step: _StepState,
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
                self.kv.get_block_ids(request_id)[:],  # a copy: the table grows later
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
        self._charge(request, tenant, start, end, sample)
        if request_id not in self._known_to_runner:
            self._known_to_runner.add(request_id)
            step.new_requests.append(
                NewRequestData(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                )
            )

    def _charge(
        self, request: Request, tenant: TenantState, start: int, end: int, sample: bool
    ) -> None:
        """Charge the tenant for prompt tokens computed the first time and a sampled token.

        Prompt tokens served by the prefix cache or recomputed after a preemption are free.
        """
        charged = self._num_prompt_charged[request.request_id]
        num_prompt_tokens = len(request.prompt_token_ids)
        num_prompt = 0
        if charged < end and charged < num_prompt_tokens:  # prompt tokens not charged
            prompt_end = min(end, num_prompt_tokens)
            num_prompt = max(prompt_end - max(start, charged), 0)
            self._num_prompt_charged[request.request_id] = prompt_end
        self._book.charge(tenant, num_prompt, int(sample))

    def _tenant(self, request: Request) -> TenantState:
        return self._book.tenant_of(request)

    def _queue_key(self, request: Request, tenant: TenantState) -> tuple:
        return edf_key(request, tenant.policy, self._arrival_seq[request.request_id])

    # ------------------------------------------------------------------------------- finish
    def _finish(
        self, request: Request, reason: FinishReason, stop_reason: int | str | None
    ) -> None:
        """Mark finished and free its blocks; `_drop_finished` removes it from the running list
        (a waiting request leaves its queue here)."""
        tenant = self._tenant(request)
        if request.status is RequestStatus.RUNNING:
            self._release(request, tenant)
            self._running_finished = True
        else:
            self.kv.free(request)  # holds no blocks, but drops its cached hashes
            self._book.remove_waiting(tenant, request)
            self.swapper.drop(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        del self._requests[request.request_id]
        del self._arrival_seq[request.request_id]
        del self._num_prompt_charged[request.request_id]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.remove(request.request_id)
            self._finished_ids.append(request.request_id)

    def _drop_finished(self) -> None:
        if self._running_finished:
            self._running = [r for r in self._running if not r.is_finished]
            self._running_finished = False
