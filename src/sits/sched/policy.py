"""Ordering rules of the scheduler: waiting queues, which tenant goes next, who is preempted.

Pure functions of state (no clocks, no randomness): every key ends in a unique tie-break
(tenant index or arrival sequence number), so the same state always gives the same order.

Rules (tenant-aware mode):
- Within a tenant, waiting requests are served by (request priority, SLO deadline, arrival):
  earliest deadline first, the deadline of a request's next token being arrival_time + ttft
  + num_output_tokens * tpot (see `deadline_s`).
- Across tenants, the next request comes from the backlogged tenant with the smallest
  (tier, tenant priority, virtual token counter, tenant index): guaranteed before burstable
  before best-effort, then lower priority value, then the least weighted service so far
  (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
- The preemption victim is the largest (borrowing blocks, tier, tenant priority, request
  priority, over-share, arrival): tenants holding blocks beyond their reservation first,
  best-effort before burstable before guaranteed, the least important and most over-served
  tenant, the latest arrival.
With no tenants configured the waiting queue is plain FIFO (preempted requests at its front)
and the victim is the latest arrival, which is today's FCFS behaviour.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sits.core.request import Request
from sits.sched.config import TenantPolicy, TenantTier

if TYPE_CHECKING:
    from sits.sched.tenants import TenantState

TIER_RANK = {TenantTier.GUARANTEED: 0, TenantTier.BURSTABLE: 1, TenantTier.BEST_EFFORT: 2}


def deadline_s(request: Request, policy: TenantPolicy) -> float:
    """Deadline (time.monotonic() seconds) of the request's next token under the tenant's SLOs.

    arrival_time + ttft_ms / 1000 + num_output_tokens * tpot_ms / 1000; math.inf when the
    tenant has no TTFT SLO (those requests are then served in arrival order).
    """
    if policy.ttft_ms is None:
        return math.inf
    tpot_ms = policy.tpot_ms or 0.0
    return request.arrival_time + (policy.ttft_ms + request.num_output_tokens * tpot_ms) / 1000


def edf_key(request: Request, policy: TenantPolicy, arrival_seq: int) -> tuple:
    """Order of a tenant's waiting requests: (request priority, deadline, arrival)."""
    return (request.priority, deadline_s(request, policy), request.arrival_time, arrival_seq)


def tenant_order_key(tenant: TenantState) -> tuple:
    """Which backlogged tenant is served next: the smallest key."""
    policy = tenant.policy
    return (TIER_RANK[policy.tier], policy.priority, tenant.virtual_counter, tenant.index)


def running_order_key(tenant: TenantState) -> tuple:
    """Order of running requests in a step (a stable sort keeps admission order within it).

    Tenants within their reservation first (their growth may then preempt borrowers that are
    not yet scheduled), then by tier and tenant priority.
    """
    return (tenant.is_borrowing, TIER_RANK[tenant.policy.tier], tenant.policy.priority)


def victim_key(request: Request, tenant: TenantState, arrival_seq: int, fair: bool) -> tuple:
    """Preemption order: the running request with the LARGEST key is preempted first.

    Args:
        request: a running request.
        tenant: its tenant's state.
        arrival_seq: the request's add order (tie-break of equal arrival times).
        fair: tenant-aware mode; False keeps FCFS's rule (latest arrival only).
    """
    if not fair:
        return (request.arrival_time, arrival_seq)
    policy = tenant.policy
    return (
        tenant.blocks_used > tenant.reserved_blocks,  # holds borrowed blocks
        TIER_RANK[policy.tier],
        policy.priority,
        request.priority,
        tenant.over_share,
        request.arrival_time,
        arrival_seq,
    )


class WaitingQueue:
    """One tenant's waiting requests in service order, with their load kept as they come and
    go (`load`), so the stats need no pass over the queue.

    Args:
        fifo: True for FCFS (new requests at the back, preempted ones at the front); False
            for keyed order (`edf_key`), where a preempted request re-enters by its key.
    """

    def __init__(self, fifo: bool) -> None:
        self.fifo = fifo
        self._fifo: deque[Request] = deque()
        self._keyed: list[tuple[tuple, Request]] = []
        # Per request tenant id (one FIFO queue may hold several): tokens queued, and a
        # min-heap of (arrival_time, push number, request id) whose stale entries (requests
        # no longer queued, or queued again under a newer push number) are dropped lazily.
        self._tokens: dict[str, int] = {}
        self._arrivals: dict[str, list[tuple[float, int, str]]] = {}
        self._pushed: dict[str, tuple[int, int]] = {}  # request id -> (push number, tokens)
        self._num_pushes = 0

    def push(self, request: Request, key: tuple, *, preempted: bool = False) -> None:
        """Queue a request (`key` orders it in keyed mode; FIFO mode ignores it)."""
        if not self.fifo:
            bisect.insort(self._keyed, (key, request), key=lambda item: item[0])
        elif preempted:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)
        tenant_id, num_tokens = request.tenant_id, len(request.all_token_ids)
        self._num_pushes += 1
        self._pushed[request.request_id] = (self._num_pushes, num_tokens)
        self._tokens[tenant_id] = self._tokens.get(tenant_id, 0) + num_tokens
        heap = self._arrivals.setdefault(tenant_id, [])
        heapq.heappush(heap, (request.arrival_time, self._num_pushes, request.request_id))
        if len(heap) > 2 * len(self) + 16:  # stale entries piled up under an old one
            heap[:] = [e for e in heap if self._pushed.get(e[2], (0,))[0] == e[1]]
            heapq.heapify(heap)

    def load(self) -> dict[str, tuple[float, int]]:
        """Request tenant id -> (arrival_time of its oldest queued request, tokens of its
        queued requests: all of each one's tokens, prompt and outputs, as when queued), for
        the tenant ids with queued requests. O(tenant ids) amortized."""
        out = {}
        for tenant_id, heap in self._arrivals.items():
            while heap and self._pushed.get(heap[0][2], (0,))[0] != heap[0][1]:
                heapq.heappop(heap)
            if heap:
                out[tenant_id] = (heap[0][0], self._tokens[tenant_id])
        return out

    def remove(self, request: Request) -> None:
        """Take a queued request out (by identity; it must be queued)."""
        _, num_tokens = self._pushed.pop(request.request_id)
        self._tokens[request.tenant_id] -= num_tokens
        if self.fifo:
            if self._fifo[0] is request:
                self._fifo.popleft()
            else:
                self._fifo = deque(r for r in self._fifo if r is not request)
            return
        index = next(i for i, (_, r) in enumerate(self._keyed) if r is request)
        del self._keyed[index]

    def __iter__(self) -> Iterator[Request]:
        if self.fifo:
            return iter(self._fifo)
        return (request for _, request in self._keyed)

    def __len__(self) -> int:
        return len(self._fifo) if self.fifo else len(self._keyed)
