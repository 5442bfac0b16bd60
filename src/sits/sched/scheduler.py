"""`Scheduler`: continuous batching under one token budget per step, with preemption.

The scheduler is one state object and plain functions over it:
- `sits.sched.state`: `SchedulerState` (requests, running list, tenant book, KV manager, swap
  planner, counters), the request lifecycle (add, finish), applying a computed (or, with
  async scheduling, launched) step, and read-only views for the engine's policies and stats;
- `sits.sched.planner`: `plan_step`, the step's decisions (reclaim, running, waiting; the
  rules and invariants are in its docstring);
- `sits.sched.tenants`: the tenant book and every order (waiting queues, tenants, running
  requests, victims).
`Scheduler` owns one `SchedulerState` and is the API the engine and the tests call; it keeps
no state of its own.

Invariants: every decision is a pure function of the state (no clocks, no randomness), so the
same inputs give the same plans (identical across TP ranks, testable exactly on CPU).
"""

from __future__ import annotations

from collections.abc import Iterable

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import StepPlan, StepResult
from sits.core.request import FinishReason, Request
from sits.kvcache.host_pool import HostBlockPool, SwapStats
from sits.kvcache.kv_manager import KVCacheManager, PrefixCacheStats
from sits.sched.config import SchedulerConfig, TenantTier
from sits.sched.planner import plan_step
from sits.sched.state import (
    SchedulerState,
    add_request,
    apply_step_ahead,
    apply_step_result,
    finish_requests,
    new_state,
    prompt_tokens_at_risk,
    queued_prefill,
    reclaim_due_tenants,
    waiting_request_ids,
)
from sits.sched.swap import SwapPlanner
from sits.sched.tenants import TenantSchedStats


class Scheduler:
    """Continuous-batching scheduler over a paged KV cache with prefix caching and tenants.

    Args:
        config: step limits, KV cache geometry and tenant policies (none: plain FCFS).

    Typical step: `plan = schedule()`; the runner computes it; `outputs = update(plan,
    result)`. Between steps, `add_request` and `finish_requests` (aborts, stop strings).

    Attributes:
        state: everything the scheduler knows (`SchedulerState`); the functions of
            `sits.sched` that this class calls take it explicitly.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.state: SchedulerState = new_state(config)

    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    @property
    def kv(self) -> KVCacheManager:
        """The device KV cache manager (block tables, prefix cache)."""
        return self.state.kv

    @property
    def swapper(self) -> SwapPlanner:
        """The host KV tier's bookkeeping."""
        return self.state.swapper

    @property
    def last_tokens_by_tenant(self) -> dict[str, int]:
        """Tokens the last `schedule()` scheduled, per request tenant id."""
        return self.state.last_tokens_by_tenant

    # ---------------------------------------------------------------------- requests, steps
    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING) in its tenant's waiting queue.

        Raises:
            InvalidParameterError: empty prompt ("prompt"), negative max_tokens, a request
                id already in use ("request_id"), or, with tenants configured, a tenant_id
                that is not one of them ("tenant_id").
            PromptTooLongError: prompt + max_tokens exceeds max_model_len, or needs more KV
                blocks than the whole cache holds (it could never run).
        """
        add_request(self.state, request)

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
        return finish_requests(self.state, request_ids, reason, stop_reason)

    def schedule(
        self,
        max_prefill_tokens: int | None = None,
        reclaim_tenants: frozenset[str] | None = None,
    ) -> StepPlan:
        """Decide this step's work (`planner.plan_step`: reclaim, running, then waiting).

        Args:
            max_prefill_tokens: at most this many prompt/recompute tokens in the step (TPOT
                pacing, `sits.sched.step_policy`); decodes are not limited. None: the budget.
            reclaim_tenants: the guaranteed tenants that may preempt borrowers to get their
                reservation back in this step; None: all of them.

        Returns:
            The plan: scheduled requests in batch order, requests new to the runner, and the
            ids of requests finished since the last call that the runner had been sent.
        """
        return plan_step(self.state, max_prefill_tokens, reclaim_tenants)

    def update_ahead(self, plan: StepPlan) -> None:
        """Async scheduling: apply a launched step before its tokens are known
        (`state.apply_step_ahead`); `update(plan, result)` completes it."""
        apply_step_ahead(self.state, plan)

    def update(self, plan: StepPlan, result: StepResult) -> list[EngineCoreOutput]:
        """Apply a computed step (`state.apply_step_result`).

        Returns:
            One output per scheduled request that got a token, logprobs or prompt logprobs,
            or finished, in plan order.

        Raises:
            KeyError: the result lacks a sampled token for a request with `sample=True`.
        """
        return apply_step_result(self.state, plan, result)

    # ------------------------------------------------------------------------------ queries
    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished requests are dropped), or None."""
        return self.state.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.state.requests)

    def waiting_request_ids(self) -> list[str]:
        """Waiting request ids in service order (`state.waiting_request_ids`)."""
        return waiting_request_ids(self.state)

    def queued_prefill(self) -> dict[str, tuple[float | None, int]]:
        """Request tenant id -> (oldest waiting arrival_time or None, tokens still to
        prefill), for tenant ids with any (`state.queued_prefill`)."""
        return queued_prefill(self.state)

    def prompt_tokens_at_risk(
        self, now_s: float, slack_fraction: float, tenant_ids: Iterable[str]
    ) -> int:
        """Prompt tokens still to compute of requests whose first token is at risk
        (`state.prompt_tokens_at_risk`; `now_s`: time.monotonic())."""
        return prompt_tokens_at_risk(self.state, now_s, slack_fraction, tenant_ids)

    def reclaim_due_tenants(self, now_s: float, patience_fraction: float) -> frozenset[str]:
        """Guaranteed tenants that may reclaim their reservation by preemption now
        (`state.reclaim_due_tenants`; `now_s`: time.monotonic())."""
        return reclaim_due_tenants(self.state, now_s, patience_fraction)

    def running_request_ids(self) -> list[str]:
        """Running request ids in running (admission) order."""
        return [r.request_id for r in self.state.running]

    def running_requests(self) -> list[Request]:
        """Running requests in running (admission) order (a copy of the list; the requests
        themselves are the scheduler's: read, do not change)."""
        return list(self.state.running)

    @property
    def num_running(self) -> int:
        return len(self.state.running)

    @property
    def num_waiting(self) -> int:
        return self.state.book.num_waiting

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the scheduler started (cumulative)."""
        return self.state.num_preemptions

    @property
    def host(self) -> HostBlockPool:
        """The host KV tier's block pool (num_blocks 0 without a tier)."""
        return self.state.swapper.host

    @property
    def num_host_blocks_used(self) -> int:
        """Host KV blocks held by swapped-out requests; 0 without a host tier (no host block is
        ever used then, so the pool is not asked)."""
        swapper = self.state.swapper
        return swapper.host.num_used_blocks if swapper.enabled else 0

    @property
    def swap_stats(self) -> SwapStats:
        """Cumulative swap / recompute preemption counters."""
        return self.state.swapper.stats

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks in use, in [0, 1]."""
        return self.state.kv.usage

    @property
    def num_free_blocks(self) -> int:
        """Usable KV blocks held by no request (cached free blocks included)."""
        return self.state.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Usable KV blocks (num_blocks minus the reserved null block)."""
        return self.state.kv.num_usable_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache query and hit counters (in tokens)."""
        return self.state.kv.stats

    def tenant_stats(self) -> dict[str, TenantSchedStats]:
        """Per-tenant numbers for metrics, by tenant id in config order (empty without
        configured tenants)."""
        return self.state.book.stats()

    # ------------------------------------------------------------------------------- knobs
    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (no change) while any request holds blocks."""
        return self.state.kv.reset_prefix_cache()

    def set_borrowing_tiers(self, tiers: Iterable[TenantTier]) -> None:
        """Tiers whose tenants may start new work beyond their own reservation (default: all).

        For overload control: e.g. `{GUARANTEED}` in a yellow state makes best-effort work
        wait and stops burstable borrowing; running requests keep going. No effect without
        configured tenants.
        """
        self.state.book.set_borrowing_tiers(tiers)
