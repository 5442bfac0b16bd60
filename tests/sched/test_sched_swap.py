"""Scheduler: swap preemption to the host KV tier (decision, exact block copies, accounting).

A fake KV store checks the data flow: each step it runs the plan's swap-outs, then swap-ins,
then writes the scheduled tokens into their slots, and asserts that every scheduled request's
earlier positions hold exactly its tokens (so a resumed request really finds its KV).
"""

from __future__ import annotations

import itertools
import random

import pytest

from sits.core.errors import InvalidParameterError
from sits.core.plan import StepPlan
from sits.core.request import FinishReason, RequestStatus
from sits.sched import Scheduler
from sits.sched.config import SwapCostModel
from tests.sched.sched_testlib import fake_result, make_config, make_request, run_step, summary

BLOCK_BYTES = 1000  # 8 tokens cost 8 ms to recompute, 2 blocks 0.8 us to copy: swap wins


def counting_tokens():
    counter = itertools.count(101)
    return lambda request_id: next(counter)


class FakeKV:
    """Token ids stored per device slot and host slot, moved as a runner would move KV."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.config.block_size
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}

    def run(self, plan: StepPlan) -> None:
        for dev, host in plan.swap_out:
            self.host[host] = list(self.device.get(dev, [None] * self.block_size))
        for host, dev in plan.swap_in:
            self.device[dev] = list(self.host[host])
        for sr in plan.scheduled:
            request = self.scheduler.get_request(sr.request_id)
            tokens = request.all_token_ids
            for pos in range(sr.start_position):  # the KV it reads
                block = self.device.get(sr.block_ids[pos // self.block_size])
                assert block is not None and block[pos % self.block_size] == tokens[pos]
            for offset, token in enumerate(sr.token_ids):  # the KV it writes
                pos = sr.start_position + offset
                block = self.device.setdefault(
                    sr.block_ids[pos // self.block_size], [None] * self.block_size
                )
                block[pos % self.block_size] = token


def swap_config(**changes: object):
    values: dict[str, object] = dict(
        num_blocks=5, enable_prefix_caching=False, num_host_blocks=4, kv_bytes_per_block=1000
    )
    values.update(changes)
    return make_config(**values)


def test_victim_swaps_out_and_resumes_without_recompute() -> None:
    scheduler = Scheduler(swap_config())
    fake_kv = FakeKV(scheduler)
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    token_of = counting_tokens()

    def step() -> StepPlan:
        plan = scheduler.schedule()
        fake_kv.run(plan)
        scheduler.update(plan, fake_result(plan, token_of))
        return plan

    for _ in range(5):
        step()
    b = scheduler.get_request("B")
    # Step 6: A needs a third block; B is swapped out: its 2 computed blocks go to host 0, 1.
    plan = step()
    assert summary(plan) == [("A", 8, 1, True)]
    assert plan.scheduled[0].block_ids == [1, 3, 4]
    assert plan.swap_out == [(2, 0), (4, 1)] and plan.swap_in == []
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, 8, 1)
    assert scheduler.host.num_free_blocks == 2 and scheduler.kv.get_block_ids("B") == []
    assert scheduler.num_host_blocks_used == 2
    assert summary(step()) == [("A", 9, 1, True)]
    assert summary(step()) == [("A", 10, 1, True)]  # A finishes
    # Step 9: B gets 3 device blocks, its 2 host blocks are copied back, and it decodes on.
    plan = step()
    assert summary(plan) == [("B", 8, 1, True)]
    assert plan.scheduled[0].token_ids == [110]
    assert plan.scheduled[0].block_ids == [2, 4, 3]
    assert plan.swap_in == [(0, 2), (1, 4)] and plan.swap_out == []
    assert plan.new_requests == []
    assert scheduler.host.num_free_blocks == 2  # freed once the runner has read them
    assert summary(step()) == [("B", 9, 1, True)]
    assert scheduler.host.num_free_blocks == 4
    assert summary(step()) == [("B", 10, 1, True)]
    assert b.output_token_ids == [102, 104, 106, 108, 110, 114, 115, 116]
    assert b.status is RequestStatus.FINISHED and not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == 4 and scheduler.host.num_free_blocks == 4
    stats = scheduler.swap_stats
    assert (stats.num_swap_preemptions, stats.num_recompute_preemptions) == (1, 0)
    assert (stats.num_swap_out_blocks, stats.num_swap_in_blocks) == (2, 2)
    assert stats.num_swapped_bytes == 4 * BLOCK_BYTES and stats.num_recomputed_tokens == 0
    assert scheduler.num_preemptions == 1


@pytest.mark.parametrize(
    "changes",
    [
        dict(num_host_blocks=0),  # no host tier
        dict(num_host_blocks=1),  # B's 2 blocks do not fit
        dict(kv_bytes_per_block=10**7),  # 2 * 2e7 B / 5 GB/s = 8 ms, not < 8 tokens * 1 ms
    ],
)
def test_recompute_when_no_room_or_not_cheaper(changes: dict) -> None:
    scheduler = Scheduler(swap_config(**changes))
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    for _ in range(5):
        run_step(scheduler)
    plan, _ = run_step(scheduler)
    b = scheduler.get_request("B")
    assert plan.swap_out == [] and (b.status, b.num_computed_tokens) == (RequestStatus.WAITING, 0)
    for _ in range(2):
        run_step(scheduler)
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("B", 0, 9, True)] and plan.swap_in == []
    stats = scheduler.swap_stats
    assert (stats.num_swap_preemptions, stats.num_recompute_preemptions) == (0, 1)
    assert (stats.num_swap_out_blocks, stats.num_swapped_bytes) == (0, 0)
    assert stats.num_recomputed_tokens == 8


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_without_host_blocks_the_tier_bookkeeping_never_runs(
    monkeypatch: pytest.MonkeyPatch, prefix_caching: bool
) -> None:
    scheduler = Scheduler(swap_config(num_host_blocks=0, enable_prefix_caching=prefix_caching))
    swapper = scheduler.swapper
    assert not swapper.enabled and swapper.prefix_tier is None

    def never(*args: object) -> None:
        raise AssertionError("host tier bookkeeping ran without a host tier")

    for name in ("begin_step", "end_step", "is_swapped", "drop"):
        monkeypatch.setattr(swapper, name, never)
    for name in ("begin_step", "allocate", "read", "free", "lookup", "store"):
        monkeypatch.setattr(swapper.host, name, never)
    monkeypatch.setattr(type(swapper.host), "num_used_blocks", property(never))
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    scheduler.add_request(make_request("C", [9, 10, 11, 12], max_tokens=8, arrival_time=3.0))
    for _ in range(6):  # C (4 computed tokens) is preempted in step 1, B (8) in step 5
        run_step(scheduler)
    assert scheduler.waiting_request_ids() == ["B", "C"]
    assert [o.request_id for o in scheduler.finish_requests("C", FinishReason.ABORT)] == ["C"]
    resumes = []
    while scheduler.has_unfinished_requests():
        plan, _ = run_step(scheduler)
        resumes += [row for row in summary(plan) if row[0] == "B" and row[2] > 1]
    # B recomputes its 8 computed tokens and its newest output; with prefix caching its first
    # block hits.
    assert resumes == [("B", 4, 5, True) if prefix_caching else ("B", 0, 9, True)]
    assert scheduler.num_preemptions == 2 and scheduler.num_free_blocks == 4
    assert scheduler.num_host_blocks_used == 0
    stats = scheduler.swap_stats
    assert (stats.num_swap_preemptions, stats.num_recompute_preemptions) == (0, 2)
    assert stats.num_recomputed_tokens == 4 + 8


def test_abort_of_swapped_request_frees_its_host_blocks() -> None:
    scheduler = Scheduler(swap_config())
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    for _ in range(6):
        run_step(scheduler)
    assert scheduler.host.num_free_blocks == 2
    outputs = scheduler.finish_requests("B", FinishReason.ABORT)
    assert [o.request_id for o in outputs] == ["B"]
    assert scheduler.host.num_free_blocks == 4 and scheduler.swapper.num_swapped == 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.num_free_blocks == 4


def test_swap_cost_model_decision() -> None:
    cpu = SwapCostModel.for_device("cpu")
    assert (cpu.prefill_s_per_token, cpu.copy_bytes_per_s) == (1e-3, 5e9)
    # recompute 10 tokens = 10 ms; copy out and in of 2.5e7 bytes = 10 ms: not cheaper.
    assert not cpu.prefers_swap(10, 25_000_000)
    assert cpu.prefers_swap(10, 24_999_999)
    gpu = SwapCostModel.for_device("cuda")
    assert (gpu.prefill_s_per_token, gpu.copy_bytes_per_s) == (20e-6, 25e9)
    # recompute 100 tokens = 2 ms; copying 2.4e7 bytes out and in = 1.92 ms, 2.6e7 = 2.08 ms.
    assert gpu.prefers_swap(100, 24_000_000) and not gpu.prefers_swap(100, 26_000_000)
    with pytest.raises(InvalidParameterError):
        SwapCostModel(prefill_s_per_token=0.0, copy_bytes_per_s=1.0)
    with pytest.raises(InvalidParameterError):
        make_config(num_host_blocks=-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_host_blocks", [0, 3, 64])
def test_random_workload_kv_data_flow(seed: int, num_host_blocks: int) -> None:
    """Many requests on a tight cache: every read position holds the request's own token, all
    blocks are back at the end, and the recomputed-token counter is exact (0 when the host
    tier holds every victim)."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        make_config(
            num_blocks=13,
            max_num_batched_tokens=16,
            num_host_blocks=num_host_blocks,
            kv_bytes_per_block=BLOCK_BYTES,
            enable_prefix_caching=False,
        )
    )
    fake_kv = FakeKV(scheduler)
    for i in range(16):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 25))]
        scheduler.add_request(
            make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 25), arrival_time=i)
        )
    high_water: dict[str, int] = {}  # positions each request has computed at least once
    num_recomputed = 0
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        fake_kv.run(plan)
        for sr in plan.scheduled:
            done = high_water.get(sr.request_id, 0)
            num_recomputed += max(
                min(done, sr.start_position + sr.num_tokens) - sr.start_position, 0
            )
            high_water[sr.request_id] = max(done, sr.start_position + sr.num_tokens)
        scheduler.update(plan, fake_result(plan, lambda rid: rng.randrange(1, 50)))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == 12
    assert scheduler.host.num_free_blocks == num_host_blocks
    stats = scheduler.swap_stats
    assert scheduler.num_preemptions == stats.num_swap_preemptions + stats.num_recompute_preemptions
    assert scheduler.num_preemptions > 0
    assert stats.num_recomputed_tokens == num_recomputed
    assert stats.num_swap_in_blocks == stats.num_swap_out_blocks
    assert stats.num_swapped_bytes == 2 * stats.num_swap_out_blocks * BLOCK_BYTES
    if num_host_blocks == 0:
        assert stats.num_swap_preemptions == 0 and num_recomputed > 0
    if num_host_blocks == 64:
        assert stats.num_recompute_preemptions == 0 and num_recomputed == 0


@pytest.mark.parametrize("seed", [3, 4])
def test_swap_with_shared_prefix_blocks(seed: int) -> None:
    """With prefix caching, victims' tables hold shared blocks: copies stay exact and every
    device and host block is back at the end."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        make_config(
            num_blocks=13, max_num_batched_tokens=16, num_host_blocks=64, kv_bytes_per_block=1000
        )
    )
    fake_kv = FakeKV(scheduler)
    shared = [rng.randrange(1, 50) for _ in range(9)]
    for i in range(12):
        prompt = shared + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(4, 20)))
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        fake_kv.run(plan)
        scheduler.update(plan, fake_result(plan, lambda rid: rng.randrange(1, 50)))
    assert not scheduler.has_unfinished_requests()
    assert scheduler.prefix_cache_stats.num_hit_tokens > 0
    stats = scheduler.swap_stats
    assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
    assert scheduler.num_free_blocks == 12 and scheduler.host.num_free_blocks == 64
