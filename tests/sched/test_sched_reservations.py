"""Tenant reservations: guaranteed capacity reclaimed from borrowers, best-effort idle-only.

Config of the flood tests: 32 usable blocks of 4 tokens, 8 sequence slots, a budget of 96
tokens (more than 8 running prompts of 8 tokens: running work never exhausts it). G is
guaranteed with half of everything (16 blocks, 4 slots), B burstable with a quarter (8, 2).
"""

from __future__ import annotations

from sits.core.request import RequestStatus
from sits.sched import Scheduler, TenantPolicy, TenantTier
from tests.sched.sched_testlib import fake_result, make_config, make_request, run_step, summary

GUARANTEED = TenantPolicy(
    tenant_id="G",
    tier=TenantTier.GUARANTEED,
    reserved_kv_fraction=0.5,
    ttft_ms=100.0,
    tpot_ms=20.0,
)
BURSTABLE = TenantPolicy(tenant_id="B", tier=TenantTier.BURSTABLE, reserved_kv_fraction=0.25)
BEST_EFFORT = TenantPolicy(tenant_id="E", tier=TenantTier.BEST_EFFORT)


def flood_config(tenants: tuple[TenantPolicy, ...]):
    return make_config(
        block_size=4,
        num_blocks=33,
        max_num_seqs=8,
        max_num_batched_tokens=96,
        max_model_len=64,
        enable_prefix_caching=False,
        tenants=tenants,
    )


def test_guaranteed_tenant_takes_its_reservation_back_from_a_borrower_in_one_step() -> None:
    scheduler = Scheduler(flood_config((GUARANTEED, BURSTABLE)))
    for i in range(40):
        scheduler.add_request(make_request(f"B{i}", [3] * 8, 24, tenant_id="B"))
    for _ in range(6):
        run_step(scheduler)
    # B fills the whole cache: every block and every slot, 24 blocks beyond its reservation.
    b = scheduler.tenant_stats()["B"]
    assert (scheduler.num_free_blocks, b.blocks_used, b.blocks_borrowed) == (0, 32, 24)
    assert b.num_running == 8

    g_requests = [make_request(f"G{i}", [5] * 8, 8, tenant_id="G") for i in range(4)]
    for request in g_requests:
        scheduler.add_request(request)
    plan = scheduler.schedule()
    # Reclaim: G needs 4 * 2 blocks and 4 slots of its reservation. B7 and B6 (latest
    # arrivals, 4 blocks each) free the blocks, B5 and B4 the two missing slots.
    assert [s.request_id for s in plan.scheduled] == [f"B{i}" for i in range(4)] + [
        f"G{i}" for i in range(4)
    ]
    assert [s.num_tokens for s in plan.scheduled[4:]] == [8] * 4  # whole prompts at once
    assert scheduler.waiting_request_ids()[:5] == ["B4", "B5", "B6", "B7", "B8"]
    assert [scheduler.get_request(f"B{i}").num_preemptions for i in range(8)] == [0] * 4 + [1] * 4
    g = scheduler.tenant_stats()["G"]
    assert (g.blocks_used, g.num_running, g.num_waiting) == (8, 4, 0)
    scheduler.update(plan, fake_result(plan))

    # From then on G runs every step, is never preempted, and grows into its reservation.
    for _ in range(1, 8):
        plan, outputs = run_step(scheduler)
        assert [s.request_id for s in plan.scheduled if s.request_id[0] == "G"] == [
            f"G{i}" for i in range(4)
        ]
    assert [o.request_id for o in outputs if o.finished] == [f"G{i}" for i in range(4)]
    assert all(r.num_preemptions == 0 and r.num_output_tokens == 8 for r in g_requests)
    assert scheduler.tenant_stats()["G"].num_preemptions == 0


def run_flood(tenants: tuple[TenantPolicy, ...]) -> tuple[dict[str, int], dict[str, int]]:
    """B keeps 30 requests waiting; G sends one request every 3 steps for 60 steps.

    Returns, per G request, (steps from arrival to first schedule, steps from first schedule
    to last, inclusive), a request never scheduled in 90 steps counting 999 and 0.
    """
    scheduler = Scheduler(flood_config(tenants))
    num_b = 0
    added: dict[str, int] = {}
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for step in range(90):
        while scheduler.num_waiting < 30:
            request = make_request(f"B{num_b}", [3] * 8, 24, arrival_time=step, tenant_id="B")
            scheduler.add_request(request)
            num_b += 1
        if step % 3 == 0 and step < 60:
            request_id = f"G{step // 3}"
            request = make_request(request_id, [5] * 8, 8, arrival_time=step, tenant_id="G")
            scheduler.add_request(request)
            added[request_id] = step
        plan, _ = run_step(scheduler)
        for scheduled in plan.scheduled:
            if scheduled.request_id[0] == "G":
                first.setdefault(scheduled.request_id, step)
                last[scheduled.request_id] = step
    delays = {r: first.get(r, step + 999) - added[r] for r in added}
    spans = {r: last[r] - first[r] + 1 if r in first else 0 for r in added}
    return delays, spans


def test_guaranteed_queueing_delay_stays_bounded_while_burstable_floods() -> None:
    delays, spans = run_flood((GUARANTEED, BURSTABLE))
    # Bound: 0 steps. G's work is within its reservation (at most 3 requests of 4 blocks at
    # once), reclaimed in the step it arrives, ordered before B, and the budget (96) exceeds
    # what running requests can use (8 prompts of 8 tokens).
    assert set(delays.values()) == {0}
    assert set(spans.values()) == {8}  # 1 prefill + 7 decodes: one token every step

    fcfs_delays, _ = run_flood(())
    assert min(fcfs_delays.values()) > 60  # behind the flood under FCFS


def test_seq_slots_are_reclaimed_too() -> None:
    tenants = (
        TenantPolicy(tenant_id="G", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.5),
        BEST_EFFORT,
    )
    scheduler = Scheduler(make_config(max_num_seqs=4, tenants=tenants))  # G keeps 2 slots
    for i in range(10):
        scheduler.add_request(make_request(f"E{i}", [1], 30, arrival_time=i, tenant_id="E"))
    run_step(scheduler)
    assert scheduler.running_request_ids() == ["E0", "E1", "E2", "E3"]  # idle slots: all of them
    scheduler.add_request(make_request("G0", [1], 3, arrival_time=20.0, tenant_id="G"))
    scheduler.add_request(make_request("G1", [1], 3, arrival_time=20.0, tenant_id="G"))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("E0", 1, 1, True), ("E1", 1, 1, True), ("G0", 0, 1, True)] + [
        ("G1", 0, 1, True)
    ]
    assert scheduler.waiting_request_ids()[:3] == ["E2", "E3", "E4"]
    assert scheduler.tenant_stats()["E"].num_preemptions == 2


def test_best_effort_uses_all_idle_capacity_and_is_preempted_first() -> None:
    tenants = (BURSTABLE, BEST_EFFORT)  # B keeps 2 of 8 blocks (block_size 4) and 2 slots
    config = make_config(num_blocks=9, max_num_seqs=8, enable_prefix_caching=False, tenants=tenants)
    scheduler = Scheduler(config)
    scheduler.add_request(make_request("E0", [1, 2, 3, 4], 8, arrival_time=0.0, tenant_id="E"))
    for i in range(3):
        scheduler.add_request(
            make_request(f"B{i}", [1, 2, 3, i], 8, arrival_time=1.0 + i, tenant_id="B")
        )
    plan, _ = run_step(scheduler)
    assert summary(plan) == [(r, 0, 4, True) for r in ("B0", "B1", "B2", "E0")]  # tier order
    for _ in range(4):
        run_step(scheduler)
    assert scheduler.num_free_blocks == 0  # 2 blocks each: E0 uses idle capacity
    plan = scheduler.schedule()
    # Every request needs a third block. All four tenants' requests borrow; E0 goes first
    # although it arrived first, then B2 (latest burstable, not yet scheduled) preempts itself.
    assert summary(plan) == [("B0", 8, 1, True), ("B1", 8, 1, True)]
    assert [scheduler.get_request(r).num_preemptions for r in ("E0", "B0", "B1", "B2")] == [
        1,
        0,
        0,
        1,
    ]
    assert scheduler.get_request("E0").status is RequestStatus.WAITING


def test_closed_borrowing_makes_best_effort_wait_and_burstable_stay_in_its_reservation() -> None:
    scheduler = Scheduler(make_config(max_num_seqs=8, tenants=(BURSTABLE, BEST_EFFORT)))
    scheduler.set_borrowing_tiers({TenantTier.GUARANTEED})  # e.g. overload state "yellow"
    for i in range(4):
        scheduler.add_request(make_request(f"B{i}", [1, 2], 4, tenant_id="B"))
        scheduler.add_request(make_request(f"E{i}", [1, 2], 4, tenant_id="E"))
    plan, _ = run_step(scheduler)
    assert [s.request_id for s in plan.scheduled] == ["B0", "B1"]  # B's 2 reserved slots
    scheduler.set_borrowing_tiers(TenantTier)
    plan, _ = run_step(scheduler)
    assert [s.request_id for s in plan.scheduled] == ["B0", "B1", "B2", "B3"] + [
        f"E{i}" for i in range(4)
    ]


def test_tenant_stats_count_blocks_reservations_and_service() -> None:
    scheduler = Scheduler(flood_config((GUARANTEED, BURSTABLE)))
    scheduler.add_request(make_request("B0", list(range(10)), 4, tenant_id="B"))
    for i in range(3):
        scheduler.add_request(make_request(f"b{i}", [1, 2], 2, tenant_id="B"))
    run_step(scheduler)
    stats = scheduler.tenant_stats()
    assert list(stats) == ["G", "B"]
    b = stats["B"]
    assert (b.num_running, b.num_waiting, b.blocks_used) == (4, 0, 3 + 3 * 1)
    assert (b.blocks_reserved, b.seqs_reserved, b.blocks_borrowed) == (8, 2, 0)
    assert (b.tokens_served, b.virtual_counter) == (10 + 1 + 3 * (2 + 1), 10 + 2 + 3 * 4)
    g = stats["G"]
    assert (g.blocks_reserved, g.seqs_reserved, g.blocks_used, g.virtual_counter) == (
        16,
        4,
        0,
        0.0,
    )


def test_a_tenant_barred_from_borrowing_does_not_stop_others_from_borrowing() -> None:
    scheduler = Scheduler(make_config(max_num_seqs=8, tenants=(BURSTABLE, BEST_EFFORT)))
    scheduler.set_borrowing_tiers({TenantTier.BEST_EFFORT})
    for i in range(3):
        scheduler.add_request(make_request(f"B{i}", [1, 2], 4, tenant_id="B"))
    for i in range(2):
        scheduler.add_request(make_request(f"E{i}", [1, 2], 4, tenant_id="E"))
    plan, _ = run_step(scheduler)
    # B2 waits (B may not go beyond its 2 slots), which is no shortage: E still borrows.
    assert [s.request_id for s in plan.scheduled] == ["B0", "B1", "E0", "E1"]


def test_a_borrower_is_preempted_before_a_lower_tier_within_its_reservation() -> None:
    tenants = (
        TenantPolicy(tenant_id="G", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.25),
        TenantPolicy(tenant_id="B", tier=TenantTier.BURSTABLE, reserved_kv_fraction=0.5),
    )  # 8 usable blocks: G keeps 2 (1 slot), B keeps 4 (2 slots)
    config = make_config(num_blocks=9, max_num_seqs=4, enable_prefix_caching=False, tenants=tenants)
    scheduler = Scheduler(config)
    for request_id in ("G0", "G1"):
        scheduler.add_request(make_request(request_id, list(range(12)), 8, tenant_id="G"))
    scheduler.add_request(make_request("B0", list(range(8)), 8, arrival_time=1.0, tenant_id="B"))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("G0", 0, 12, True), ("G1", 0, 12, True), ("B0", 0, 8, True)]
    assert scheduler.num_free_blocks == 0
    assert scheduler.tenant_stats()["G"].blocks_borrowed == 4
    plan = scheduler.schedule()
    # B0 (within its reservation, run first) needs a third block: G borrows 4 blocks, so G1
    # is preempted although G's tier is higher; G0 then gets one of the freed blocks.
    assert summary(plan) == [("B0", 8, 1, True), ("G0", 12, 1, True)]
    assert scheduler.waiting_request_ids() == ["G1"]
    assert scheduler.get_request("B0").num_preemptions == 0


def test_among_equal_borrowers_the_most_over_share_tenant_is_preempted() -> None:
    tenants = (TenantPolicy(tenant_id="X"), TenantPolicy(tenant_id="Y"))  # best-effort both
    config = make_config(num_blocks=9, max_num_seqs=4, enable_prefix_caching=False, tenants=tenants)
    scheduler = Scheduler(config)
    for request_id in ("X0", "X1"):
        scheduler.add_request(make_request(request_id, list(range(12)), 8, tenant_id="X"))
    scheduler.add_request(make_request("Y0", list(range(8)), 8, arrival_time=1.0, tenant_id="Y"))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("X0", 0, 12, True), ("Y0", 0, 8, True), ("X1", 0, 12, True)]
    plan = scheduler.schedule()
    # X holds 6 blocks, Y 2: X1 goes although Y0 arrived last.
    assert summary(plan) == [("X0", 12, 1, True), ("Y0", 8, 1, True)]
    assert scheduler.waiting_request_ids() == ["X1"]


def test_a_held_back_reclaim_waits_for_finishing_requests_then_preempts_when_due() -> None:
    """`reclaim_tenants` without G: G's protected slots take what finishing borrowers free (no
    recompute); once due (`reclaim_due_tenants`: its oldest wait >= 0.25 x its 100 ms TTFT
    SLO), G preempts as before."""
    tenants = (GUARANTEED, BEST_EFFORT)  # G keeps 2 of 4 slots
    scheduler = Scheduler(make_config(max_num_seqs=4, tenants=tenants))
    for i in range(10):  # E0 finishes after 2 tokens, the others run long
        max_tokens = 2 if i == 0 else 30
        scheduler.add_request(make_request(f"E{i}", [1], max_tokens, arrival_time=i, tenant_id="E"))
    run_step(scheduler)
    assert scheduler.running_request_ids() == ["E0", "E1", "E2", "E3"]
    scheduler.add_request(make_request("G0", [1], 3, arrival_time=20.0, tenant_id="G"))
    scheduler.add_request(make_request("G1", [1], 3, arrival_time=20.0, tenant_id="G"))
    assert scheduler.reclaim_due_tenants(20.0234375, 0.25) == frozenset()  # waited < 25 ms
    plan = scheduler.schedule(reclaim_tenants=frozenset())
    # Nobody is preempted; E0 decodes its last token and frees its slot after this step.
    assert [s.request_id for s in plan.scheduled] == ["E0", "E1", "E2", "E3"]
    outputs = scheduler.update(plan, fake_result(plan))
    assert [o.request_id for o in outputs if o.finished] == ["E0"]
    plan = scheduler.schedule(reclaim_tenants=frozenset())
    # The freed slot goes to G0 (protected: no E request takes it); still no preemption.
    assert [s.request_id for s in plan.scheduled] == ["E1", "E2", "E3", "G0"]
    scheduler.update(plan, fake_result(plan))
    assert scheduler.tenant_stats()["E"].num_preemptions == 0
    assert scheduler.reclaim_due_tenants(20.03125, 0.25) == frozenset({"G"})  # G1 is due now
    plan = scheduler.schedule(reclaim_tenants=frozenset({"G"}))
    assert [s.request_id for s in plan.scheduled] == ["G0", "E1", "E2", "G1"]
    assert scheduler.tenant_stats()["E"].num_preemptions == 1  # E3, the latest arrival
    # A guaranteed tenant without a TTFT SLO is always due; other tiers never are.
    plain = TenantPolicy(tenant_id="P", tier=TenantTier.GUARANTEED, reserved_kv_fraction=0.25)
    other = Scheduler(make_config(max_num_seqs=4, tenants=(plain, BEST_EFFORT)))
    other.add_request(make_request("P0", [1], 3, arrival_time=5.0, tenant_id="P"))
    other.add_request(make_request("E0", [1], 3, arrival_time=5.0, tenant_id="E"))
    assert other.reclaim_due_tenants(5.0, 0.25) == frozenset({"P"})
