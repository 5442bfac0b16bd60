"""Tenant-aware scheduling on a random workload: same outputs, exact ledgers, determinism.

Reservations, reclaims, fair share and EDF change only WHEN requests run, never WHAT they
produce (the fake runner is a pure function of each sequence), and every per-tenant number
the scheduler keeps must match what the block tables say.
"""

from __future__ import annotations

from sits.sched import Scheduler, TenantPolicy, TenantTier
from tests.sched.sched_testlib import make_config
from tests.sched.test_sched_invariants import PureRunner, check_block_accounting, make_workload

TENANTS = (
    TenantPolicy(
        tenant_id="G",
        tier=TenantTier.GUARANTEED,
        reserved_kv_fraction=0.3,
        ttft_ms=500.0,
        tpot_ms=50.0,
    ),
    TenantPolicy(tenant_id="B", tier=TenantTier.BURSTABLE, reserved_kv_fraction=0.2, weight=2.0),
    TenantPolicy(tenant_id="E", tier=TenantTier.BEST_EFFORT),
    TenantPolicy(tenant_id="L", tier=TenantTier.BEST_EFFORT, priority=1, ttft_ms=100.0),
)


def check_tenant_ledgers(scheduler: Scheduler) -> None:
    stats = scheduler.tenant_stats()
    blocks: dict[str, set[int]] = {t.tenant_id: set() for t in TENANTS}
    running = dict.fromkeys(blocks, 0)
    waiting = dict.fromkeys(blocks, 0)
    for request_id in scheduler.running_request_ids():
        tenant_id = scheduler.get_request(request_id).tenant_id
        blocks[tenant_id].update(scheduler.kv.get_block_ids(request_id))
        running[tenant_id] += 1
    for request_id in scheduler.waiting_request_ids():
        waiting[scheduler.get_request(request_id).tenant_id] += 1
    for tenant_id, tenant_stats in stats.items():
        assert tenant_stats.blocks_used == len(blocks[tenant_id]), tenant_id
        assert (tenant_stats.num_running, tenant_stats.num_waiting) == (
            running[tenant_id],
            waiting[tenant_id],
        )


def run_tenant_workload(scheduler: Scheduler, seed: int) -> tuple[dict[str, list[int]], list]:
    """Run to completion; returns (outputs per request, every plan's (id, start, n) list)."""
    workload = make_workload(seed)
    for _, request in workload:
        index = int(request.request_id[1:].split("-")[0])  # siblings share their tenant
        request.tenant_id = TENANTS[index % len(TENANTS)].tenant_id
    runner = PureRunner(scheduler.config.block_size)
    trace = []
    for step in range(10_000):
        for add_step, request in workload:
            if add_step == step:
                scheduler.add_request(request)
        if step >= 40 and not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(plan.scheduled) <= scheduler.config.max_num_seqs
        trace.append([(s.request_id, s.start_position, s.num_tokens) for s in plan.scheduled])
        scheduler.update(plan, runner.run(plan))
        check_block_accounting(scheduler)
        check_tenant_ledgers(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert all(s.blocks_used == 0 for s in scheduler.tenant_stats().values())
    requests = [request for _, request in workload]
    for request in requests:
        assert request.num_output_tokens == request.max_tokens
    return {r.request_id: list(r.output_token_ids) for r in requests}, trace


def test_tenant_scheduling_changes_when_not_what_and_is_deterministic() -> None:
    roomy = make_config(num_blocks=2000, max_num_batched_tokens=4096, max_num_seqs=256)
    reference, _ = run_tenant_workload(Scheduler(roomy), seed=0)

    tight = make_config(num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6, tenants=TENANTS)
    scheduler = Scheduler(tight)
    outputs, trace = run_tenant_workload(scheduler, seed=0)
    assert outputs == reference
    stats = scheduler.tenant_stats()
    assert sum(s.num_preemptions for s in stats.values()) == scheduler.num_preemptions > 0

    again, trace_again = run_tenant_workload(Scheduler(tight), seed=0)
    assert (again, trace_again) == (outputs, trace)
