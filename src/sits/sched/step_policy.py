"""`StepPolicy`: what the engine decides before each step from the clock, as a `StepDecision`.

Three per-step policies live here, each a pure function of the scheduler's state and `now_s`
(the engine passes its clock's reading; nothing here reads a clock):
- start deadlines: a request past its `Request.start_deadline_s` that never started (nothing
  computed, nothing generated; for a follower of an n>1 request, its leader neither) is
  dropped (`due_unstarted`); one that started runs on, dropping it would throw work away;
- TPOT pacing with TTFT rescue: the step's prefill budget (`TpotPacer.max_prefill_tokens`),
  lifted to at least the prompt tokens of first tokens at risk (at most `TTFT_RESCUE_SLACK` of
  their TTFT SLO left) of the tenants `ttft_rescue_tenants` names (`sits.sched.pacing`);
- reclaim: with tenants, the guaranteed tenants whose reservation may be reclaimed from
  borrowers by preemption now (`Scheduler.reclaim_due_tenants` with `RECLAIM_PATIENCE`).

Order within a step (the engine's `Stepper.plan`): drop the `due_unstarted` requests first, then
`decide`, so the dropped requests count neither as first tokens at risk nor as a tenant's
oldest waiting request. After the step, `observe_step` feeds the pacer's step-time model.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest
from sits.core.request import Request, RequestStatus
from sits.sched.config import TenantPolicy
from sits.sched.pacing import TTFT_RESCUE_SLACK, TpotPacer, ttft_rescue_tenants
from sits.sched.scheduler import Scheduler

# A guaranteed tenant preempts borrowers for its reservation once its oldest waiting request
# has used this fraction of its TTFT SLO; before that, requests finishing free the capacity at
# no recompute cost (with 200+ running, a few finish every step). On the H200 QoS runs the
# guaranteed tenant's TTFT p99 stayed at ~425 ms of 1 s with it (bench/RESULTS.md).
RECLAIM_PATIENCE = 0.25


@dataclass(frozen=True, slots=True)
class StepDecision:
    """The arguments of one `Scheduler.schedule` call.

    Attributes:
        max_prefill_tokens: prompt (or recompute) tokens the step may take; None: no limit.
        reclaim_tenants: guaranteed tenants whose reclaim by preemption is due; None without
            tenants.
    """

    max_prefill_tokens: int | None = None
    reclaim_tenants: frozenset[str] | None = None


class StepPolicy:
    """Start deadlines, TPOT pacing with TTFT rescue, and reclaim (see the module docstring).

    Args:
        tenant_policies: the tenants' policies; empty: FCFS (no pacing, no reclaim).
        pacer: the TPOT pacer (on when a tenant has a TPOT SLO).
        max_num_batched_tokens: the step's token budget (caps the TTFT rescue).

    Attributes:
        pacer: the TPOT pacer; a benchmark may swap it for one of its own.
    """

    def __init__(
        self,
        tenant_policies: Sequence[TenantPolicy],
        pacer: TpotPacer,
        max_num_batched_tokens: int,
    ) -> None:
        self.pacer = pacer
        self.max_num_batched_tokens = max_num_batched_tokens
        self._rescue_tenants = ttft_rescue_tenants(tenant_policies)
        self._has_tenants = bool(tenant_policies)
        self._start_deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id)

    def add_request(self, request: Request) -> None:
        """Note a queued request's start deadline, if it has one."""
        if request.start_deadline_s is not None:
            heapq.heappush(self._start_deadlines, (request.start_deadline_s, request.request_id))

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the pacing schedules of requests finished from outside (unknown ids ignored;
        their deadlines are skipped when due)."""
        self.pacer.forget(request_ids)

    def due_unstarted(self, now_s: float, scheduler: Scheduler) -> list[str]:
        """The requests to drop now: past their start deadline and never started (nor, for
        a follower of an n>1 request, its leader). The engine finishes them ABORT with
        stop_reason `START_DEADLINE_MISSED`; their outputs lead the step's outputs.

        Args:
            now_s: the engine clock's seconds (time.monotonic()).
            scheduler: the scheduler that holds the requests (read only).
        """
        heap = self._start_deadlines
        due = []
        while heap and heap[0][0] <= now_s:
            _, request_id = heapq.heappop(heap)
            request = scheduler.get_request(request_id)
            if request is None or not _untouched(request):
                continue
            leader = scheduler.get_request(request.prefix_leader_id or "")
            if leader is None or _untouched(leader):
                due.append(request_id)
        return due

    def decide(self, now_s: float, scheduler: Scheduler) -> StepDecision:
        """The step's prefill budget (pacing, lifted by the TTFT rescue) and due reclaims.

        Args:
            now_s: the engine clock's seconds (time.monotonic()).
            scheduler: the scheduler about to plan the step (read; the pacer may rebase the
                token schedule of a running request over a token late).
        """
        max_prefill_tokens = None
        pacer = self.pacer
        if pacer.enabled:
            max_prefill_tokens = pacer.max_prefill_tokens(now_s, scheduler.running_requests())
            if max_prefill_tokens is not None and self._rescue_tenants:
                at_risk = scheduler.prompt_tokens_at_risk(
                    now_s, TTFT_RESCUE_SLACK, self._rescue_tenants
                )
                rescue = min(at_risk, self.max_num_batched_tokens)
                max_prefill_tokens = max(max_prefill_tokens, rescue)
        reclaim = None
        if self._has_tenants:
            reclaim = scheduler.reclaim_due_tenants(now_s, RECLAIM_PATIENCE)
        return StepDecision(max_prefill_tokens, reclaim)

    def observe_step(
        self,
        num_decodes: int,
        prefills: Sequence[ScheduledRequest],
        step_s: float,
        end_s: float,
        outputs: Sequence[EngineCoreOutput],
    ) -> None:
        """Feed the pacer one step that scheduled tokens (a no-op without pacing).

        Args:
            num_decodes: its one-token decodes; prefills: its prompt chunks and recomputes.
            step_s: its wall seconds; end_s: clock seconds when its accounting ended.
            outputs: its outputs (who got a token, who finished).
        """
        pacer = self.pacer
        if not pacer.enabled:
            return
        num_tokens = num_decodes + sum(sr.num_tokens for sr in prefills)
        pacer.observe_step(
            pacer.padded_tokens(num_tokens) if prefills else 0,
            step_s,
            end_s,
            (out.request_id for out in outputs if out.new_token_ids),
            (out.request_id for out in outputs if out.finished),
        )


def _untouched(request: Request) -> bool:
    """Waiting with nothing computed and nothing generated (never started)."""
    return (
        request.status is RequestStatus.WAITING
        and request.num_computed_tokens == 0
        and request.num_output_tokens == 0
    )
