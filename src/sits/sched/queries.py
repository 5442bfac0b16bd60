"""`SchedulerQueries`: the scheduler's read-only views and its two outside knobs (prefix-cache
reset, borrowing tiers), kept apart from the scheduling decisions in `sits.sched.scheduler`.

`Scheduler` inherits these; they read its state (requests, running list, tenant book, KV
manager, swap planner) and change no scheduling state but what their docstrings say.
"""

from __future__ import annotations

from collections.abc import Iterable

from sits.core.request import Request
from sits.kvcache.host_pool import HostBlockPool, SwapStats
from sits.kvcache.kv_manager import KVCacheManager, PrefixCacheStats
from sits.sched.config import TenantTier
from sits.sched.swap import SwapPlanner
from sits.sched.tenants import TenantBook, TenantSchedStats


class SchedulerQueries:
    """Read-only views of a `Scheduler` (its base class; never used alone)."""

    kv: KVCacheManager
    swapper: SwapPlanner
    _book: TenantBook
    _requests: dict[str, Request]
    _running: list[Request]
    _num_preemptions: int

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished requests are dropped), or None."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def waiting_request_ids(self) -> list[str]:
        """Waiting request ids in service order: tenants by `tenant_order_key` as they stand
        now, each tenant's queue front first (without tenants: the FCFS queue)."""
        return [r.request_id for t in self._book.backlogged() for r in t.queue]

    def queued_prefill(self) -> dict[str, tuple[float | None, int]]:
        """Request tenant id -> (arrival_time of its oldest waiting request, or None when none
        waits; tokens still to prefill: every token of its waiting requests plus the prompt
        tokens its running requests have not computed), for tenant ids with any.
        O(running requests + tenant ids): the queues keep their load (`WaitingQueue.load`),
        and the stats snapshot calls this every step under load (it was a pass over every
        queued request: 1.5 ms per step with 3,000 queued on the H200's host)."""
        oldest: dict[str, float] = {}
        tokens: dict[str, int] = {}
        for tenant in self._book.tenants.values():  # a tenant id's requests wait in one queue
            for tenant_id, (arrival_s, num_tokens) in tenant.queue.load().items():
                oldest[tenant_id] = arrival_s
                tokens[tenant_id] = num_tokens
        for request in self._running:
            left = len(request.prompt_token_ids) - request.num_computed_tokens
            if left > 0:
                tokens[request.tenant_id] = tokens.get(request.tenant_id, 0) + left
        return {tenant_id: (oldest.get(tenant_id), n) for tenant_id, n in tokens.items()}

    def prompt_tokens_at_risk(
        self, now_s: float, slack_fraction: float, tenant_ids: Iterable[str]
    ) -> int:
        """Prompt tokens still to compute of the requests of `tenant_ids` whose first token is
        at risk: no output token yet, and at most `slack_fraction` x the tenant's TTFT SLO left
        before arrival_time + TTFT (`now_s` on the same time.monotonic() clock). Tenants
        without a TTFT SLO add nothing. O(those tenants' waiting requests + running)."""
        total = 0
        ttft_s_of = {}
        for tenant_id in tenant_ids:
            tenant = self._book.tenants.get(tenant_id)
            if tenant is None or tenant.policy.ttft_ms is None:
                continue
            ttft_s = ttft_s_of[tenant_id] = tenant.policy.ttft_ms / 1000
            latest_arrival_s = now_s - (1 - slack_fraction) * ttft_s
            for request in tenant.queue:
                if request.num_output_tokens == 0 and request.arrival_time <= latest_arrival_s:
                    total += request.num_prompt_tokens - request.num_computed_tokens
        for request in self._running:
            ttft_s = ttft_s_of.get(request.tenant_id)
            if ttft_s is None or request.num_output_tokens > 0:
                continue
            if request.arrival_time <= now_s - (1 - slack_fraction) * ttft_s:
                total += max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        return total

    def reclaim_due_tenants(self, now_s: float, patience_fraction: float) -> frozenset[str]:
        """Guaranteed tenants with waiting work whose reservation may be reclaimed from
        borrowers by preemption now (`Scheduler.schedule`'s `reclaim_tenants`): those without
        a TTFT SLO, and those whose oldest waiting request arrived at least
        `patience_fraction` x their TTFT SLO before `now_s` (time.monotonic()). Until then
        their protected slots and blocks take what finishing requests free, with no work
        thrown away. O(tenants) amortized (`WaitingQueue.load`)."""
        due = []
        for tenant in self._book.tenants.values():
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

    def running_request_ids(self) -> list[str]:
        """Running request ids in running (admission) order."""
        return [r.request_id for r in self._running]

    def running_requests(self) -> list[Request]:
        """Running requests in running (admission) order (a copy of the list; the requests
        themselves are the scheduler's: read, do not change)."""
        return list(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self._book.num_waiting

    @property
    def num_preemptions(self) -> int:
        """Preemptions since the scheduler started (cumulative)."""
        return self._num_preemptions

    @property
    def host(self) -> HostBlockPool:
        """The host KV tier's block pool (num_blocks 0 without a tier)."""
        return self.swapper.host

    @property
    def swap_stats(self) -> SwapStats:
        """Cumulative swap / recompute preemption counters."""
        return self.swapper.stats

    @property
    def kv_usage(self) -> float:
        """Fraction of usable KV blocks in use, in [0, 1]."""
        return self.kv.usage

    @property
    def num_free_blocks(self) -> int:
        """Usable KV blocks held by no request (cached free blocks included)."""
        return self.kv.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        """Usable KV blocks (num_blocks minus the reserved null block)."""
        return self.kv.num_usable_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Cumulative prefix-cache query and hit counters (in tokens)."""
        return self.kv.stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (no change) while any request holds blocks."""
        return self.kv.reset_prefix_cache()

    def tenant_stats(self) -> dict[str, TenantSchedStats]:
        """Per-tenant numbers for metrics, by tenant id in config order (empty without
        configured tenants)."""
        return self._book.stats()

    def set_borrowing_tiers(self, tiers: Iterable[TenantTier]) -> None:
        """Tiers whose tenants may start new work beyond their own reservation (default: all).

        For overload control: e.g. `{GUARANTEED}` in a yellow state makes best-effort work
        wait and stops burstable borrowing; running requests keep going. No effect without
        configured tenants.
        """
        self._book.set_borrowing_tiers(tiers)
