"""The step policy given the clock: start deadlines, the pacing budget lifted by the TTFT
rescue, due reclaims, and what it feeds the pacer after a step (exact, on a CPU scheduler)."""

from __future__ import annotations

import dataclasses

import pytest

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest
from sits.core.request import FinishReason
from sits.sched import Scheduler
from sits.sched.config import TenantPolicy, TenantTier
from sits.sched.step_policy import RECLAIM_PATIENCE, StepDecision, StepPolicy, TpotPacer
from tests.sched.sched_testlib import fake_result, make_config, make_request, summary

GOLD = TenantPolicy(tenant_id="gold", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.5,
                    priority=0, ttft_ms=1000, tpot_ms=50)  # fmt: skip
BULK = TenantPolicy(tenant_id="bulk", tier=TenantTier.BURSTABLE, priority=1, ttft_ms=1000)


class _FixedPacer:
    """Stands in for `TpotPacer`: every step may take `budget` prompt tokens."""

    enabled = True

    def __init__(self, budget: int | None) -> None:
        self.budget = budget

    def max_prefill_tokens(self, now_s: float, running: list) -> int | None:
        return self.budget


def _policy(tenants: tuple[TenantPolicy, ...], pacer: object, budget: int = 64) -> StepPolicy:
    return StepPolicy(tenants, pacer, budget)  # type: ignore[arg-type]


def test_only_requests_never_started_are_due_at_their_start_deadline() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=8))
    policy = _policy((), TpotPacer({}, 8))
    requests = [
        make_request("started", list(range(12))),  # gets the first 8 tokens
        make_request("late", list(range(20, 30))),
        make_request("follower", list(range(12)), prefix_leader_id="started"),
        make_request("no-deadline", list(range(40, 44))),
        make_request("later", list(range(50, 54))),
    ]
    deadlines = {"started": 1.0, "late": 1.0, "follower": 1.0, "later": 2.0}
    for request in requests:
        if request.request_id in deadlines:
            request = dataclasses.replace(request, start_deadline_s=deadlines[request.request_id])
        scheduler.add_request(request)
        policy.add_request(request)
    plan = scheduler.schedule()
    assert summary(plan) == [("started", 0, 8, False)]
    scheduler.update(plan, fake_result(plan))
    assert policy.due_unstarted(0.999, scheduler) == []
    # "started" runs on; its follower too (its leader started); "later" is not due yet.
    assert policy.due_unstarted(1.0, scheduler) == ["late"]
    assert policy.due_unstarted(1.5, scheduler) == []  # each deadline is looked at once
    scheduler.finish_requests(["later"], FinishReason.ABORT)
    assert policy.due_unstarted(2.0, scheduler) == []  # finished: skipped


def test_without_tenants_there_is_no_limit_and_no_reclaim() -> None:
    scheduler = Scheduler(make_config())
    policy = _policy((), TpotPacer({}, 64))
    assert policy.decide(5.0, scheduler) == StepDecision(None, None)


def test_first_tokens_at_risk_lift_the_pacing_budget_up_to_the_step_budget() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=64, tenants=(GOLD, BULK)))
    pacer = _FixedPacer(4)
    policy = _policy((GOLD, BULK), pacer, budget=64)
    scheduler.add_request(make_request("g0", list(range(30)), arrival_time=0.0, tenant_id="gold"))
    scheduler.add_request(make_request("b0", list(range(100, 140)), tenant_id="bulk"))
    # gold (TTFT 1 s) is at risk from 0.5 s; bulk is less important than the paced gold.
    assert policy.decide(0.49, scheduler).max_prefill_tokens == 4
    assert policy.decide(0.5, scheduler).max_prefill_tokens == 30
    scheduler.add_request(
        make_request("g1", list(range(200, 240)), arrival_time=0.0, tenant_id="gold")
    )
    assert policy.decide(0.5, scheduler).max_prefill_tokens == 64  # 70 at risk, capped
    pacer.budget = 100
    assert policy.decide(0.5, scheduler).max_prefill_tokens == 100  # pacing allows more
    pacer.budget = None
    assert policy.decide(0.5, scheduler).max_prefill_tokens is None  # no limit: no rescue


def test_a_guaranteed_tenants_reclaim_is_due_after_its_patience() -> None:
    scheduler = Scheduler(make_config(tenants=(GOLD, BULK)))
    policy = _policy((GOLD, BULK), TpotPacer({}, 64))
    assert policy.decide(0.0, scheduler).reclaim_tenants == frozenset()
    scheduler.add_request(make_request("g0", list(range(8)), arrival_time=1.0, tenant_id="gold"))
    patience_s = RECLAIM_PATIENCE * GOLD.ttft_ms / 1000
    assert policy.decide(1.0 + patience_s / 2, scheduler).reclaim_tenants == frozenset()
    assert policy.decide(1.0 + patience_s, scheduler).reclaim_tenants == {"gold"}


def test_a_step_feeds_the_pacer_its_padded_tokens_and_first_tokens() -> None:
    pacer = TpotPacer({"gold": 0.05}, 64, token_buckets=(32, 64))
    policy = _policy((GOLD,), pacer)
    prefill = ScheduledRequest("a", list(range(20)), 0, [0, 1, 2, 3, 4], True)
    outputs = [EngineCoreOutput("a", [7]), EngineCoreOutput("d", [])]
    policy.observe_step(3, [prefill], 0.25, 10.0, outputs)  # 3 + 20 tokens run as 32
    assert pacer.model.num_mixed_samples == 1
    assert pacer.model.mixed_line() == (0.0, pytest.approx(0.25 / 32, rel=1e-12))
    policy.observe_step(5, [], 0.01, 10.5, [EngineCoreOutput("a", [7])])  # decode-only
    assert pacer.model.decode_s == 0.01
    # "a" got its first token at 10.0, so with a 45 ms schedule its next is due at 10.045:
    # 25 ms of slack at 10.02 fit no chunk (a budget of 0); unrecorded, there were no limit.
    request = make_request("a", [1, 2], tenant_id="gold")
    request.num_computed_tokens = 2
    request.append_output_token(7)
    assert pacer.max_prefill_tokens(10.02, [request]) == 0
    assert pacer.max_prefill_tokens(10.02, [dataclasses.replace(request, request_id="x")]) is None
