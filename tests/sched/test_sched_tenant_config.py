"""Tenant policies: validation, reservation rounding, unknown tenants, FCFS without tenants."""

from __future__ import annotations

import pytest

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.sched import Scheduler, SchedulerConfig, TenantPolicy, TenantTier, reserved_amount
from sits.sched.tenants import TenantBook
from tests.sched.sched_testlib import make_config, make_request, run_step


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tenant_id": ""}, "tenant_id"),
        ({"reserved_kv_fraction": 1.5, "tier": TenantTier.GUARANTEED}, "reserved_kv_fraction"),
        ({"reserved_kv_fraction": 0.1}, "reserved_kv_fraction"),  # best_effort reserves 0
        ({"weight": 0.0}, "weight"),
        ({"ttft_ms": -1.0}, "ttft_ms"),
        ({"tpot_ms": float("nan")}, "tpot_ms"),
        ({"tier": "guaranteed"}, "tier"),
    ],
)
def test_invalid_tenant_policies_name_the_field(fields: dict, param: str) -> None:
    values = {"tenant_id": "t", **fields}
    with pytest.raises(InvalidParameterError) as info:
        TenantPolicy(**values)
    assert info.value.param == param


def guaranteed(tenant_id: str, fraction: float) -> TenantPolicy:
    return TenantPolicy(
        tenant_id=tenant_id, tier=TenantTier.GUARANTEED, reserved_kv_fraction=fraction
    )


@pytest.mark.parametrize(
    ("tenants", "max_num_seqs", "message"),
    [
        ((guaranteed("a", 0.5), guaranteed("a", 0.1)), 8, r"duplicate tenant ids: \[.a.\]"),
        ((guaranteed("a", 0.6), guaranteed("b", 0.5)), 8, "sums to 1.1 > 1"),
        (tuple(guaranteed(f"t{i}", 0.1) for i in range(3)), 2, "need 3 seqs"),
    ],
)
def test_tenant_sets_that_cannot_be_honoured_are_refused(
    tenants: tuple[TenantPolicy, ...], max_num_seqs: int, message: str
) -> None:
    with pytest.raises(InvalidParameterError, match=message) as info:
        make_config(tenants=tenants, max_num_seqs=max_num_seqs)
    assert info.value.param == "tenants"


def test_reserved_amount_floors_but_keeps_at_least_one() -> None:
    assert reserved_amount(0.5, 33) == 16
    assert reserved_amount(0.1 + 0.2, 10) == 3  # float slack: 0.30000000000000004 * 10
    assert reserved_amount(1 / 3, 3) == 1
    assert reserved_amount(0.01, 10) == 1
    assert reserved_amount(0.0, 10) == 0
    make_config(tenants=(guaranteed("a", 0.1), guaranteed("b", 0.2), guaranteed("c", 0.7)))


def test_engine_config_mapping_carries_tenants() -> None:
    tenants = (guaranteed("a", 0.5),)
    config = SchedulerConfig.from_engine_config(
        EngineConfig(model="m"), num_blocks=10, max_model_len=64, tenants=tenants
    )
    assert config.tenants == tenants and config.vtc_output_weight == 2.0


def test_unknown_tenant_is_refused_and_leaves_no_trace() -> None:
    scheduler = Scheduler(make_config(tenants=(guaranteed("a", 0.5),)))
    with pytest.raises(InvalidParameterError, match="unknown tenant 'b'") as info:
        scheduler.add_request(make_request("r", [1], 1, tenant_id="b"))
    assert info.value.param == "tenant_id"
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request(make_request("r", [1], 1, tenant_id="a"))  # the id is still free
    assert scheduler.waiting_request_ids() == ["r"]


def test_without_tenants_every_tenant_id_shares_one_fcfs_queue() -> None:
    scheduler = Scheduler(make_config(max_num_seqs=1))
    for request_id, tenant_id in (("x", "zeta"), ("y", "alpha"), ("z", "zeta")):
        scheduler.add_request(make_request(request_id, [1], 1, tenant_id=tenant_id, priority=-5))
    scheduler.set_borrowing_tiers(())  # no effect without tenants
    order = [run_step(scheduler)[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["x", "y", "z"]
    assert scheduler.tenant_stats() == {}


def test_protected_blocks_and_slots_keep_a_reservation_for_waiting_work() -> None:
    tenants = (guaranteed("g", 0.5), TenantPolicy(tenant_id="e"))
    config = make_config(num_blocks=17, max_num_seqs=4, block_size=4, tenants=tenants)
    book = TenantBook(config)
    g, e = book.tenants["g"], book.tenants["e"]
    assert (g.reserved_blocks, g.reserved_seqs, e.reserved_blocks) == (8, 2, 0)
    assert book.blocks_available(e, 16) == 16  # nobody waits: all idle capacity
    book.push_waiting(g, make_request("g0", list(range(10)), 1, tenant_id="g"), 0)
    assert (g.demand_blocks, g.protected_blocks, g.protected_seqs) == (3, 3, 1)
    assert book.blocks_available(e, 16) == 13 and book.blocks_available(g, 16) == 16
    assert book.may_take_blocks(e, 13, 16, within_reservation=False)
    assert not book.may_take_blocks(e, 14, 16, within_reservation=False)
    assert not book.may_take_blocks(e, 1, 16, within_reservation=True)  # reserves nothing
    assert book.may_take_blocks(g, 8, 16, within_reservation=True)
    assert not book.may_take_blocks(g, 9, 16, within_reservation=True)
    assert book.seqs_available(e) == 3 and book.seqs_available(g) == 4
    assert book.block_shortfall(g, 2) == 1 and book.block_shortfall(g, 3) == 0
