"""Scheduler + host prefix tier on random traffic with shared prefixes: exact KV data flow.

A fake KV store runs each plan as a runner must (swap-outs, then swap-ins, then the forward's
writes) and checks that every position a scheduled request reads holds that request's own
token, so a prefix block served from the host tier really holds the prefix. Swap preemption
shares the host blocks (its blocks take precedence). At the end every device and host block is
free again and the counters agree with the copies the plans carried.
"""

from __future__ import annotations

import random

import pytest

from sits.core.plan import StepPlan
from sits.sched import Scheduler
from tests.sched.sched_testlib import fake_result, make_config, make_request


class FakeKV:
    """Token ids per device and host block, moved as the runner moves KV."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.config.block_size
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}
        self.num_out = 0
        self.num_in = 0

    def run(self, plan: StepPlan) -> None:
        out_hosts = [h for _, h in plan.swap_out]
        in_devices = [d for _, d in plan.swap_in]
        assert len(set(out_hosts)) == len(out_hosts), plan.swap_out  # no host block written twice
        assert len(set(in_devices)) == len(in_devices), plan.swap_in
        for dev, host in plan.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in plan.swap_in:
            self.device[dev] = list(self.host[host])
        self.num_out += len(plan.swap_out)
        self.num_in += len(plan.swap_in)
        for sr in plan.scheduled:
            tokens = self.scheduler.get_request(sr.request_id).all_token_ids
            for pos in range(sr.start_position):
                block = self.device[sr.block_ids[pos // self.block_size]]
                assert block[pos % self.block_size] == tokens[pos], (sr.request_id, pos)
            for offset, token in enumerate(sr.token_ids):
                pos = sr.start_position + offset
                block = self.device.setdefault(
                    sr.block_ids[pos // self.block_size], [None] * self.block_size
                )
                block[pos % self.block_size] = token


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_host_blocks", [4, 12, 64])
def test_random_prefix_traffic_through_the_host_tier(seed: int, num_host_blocks: int) -> None:
    rng = random.Random(seed)
    scheduler = Scheduler(
        make_config(
            num_blocks=13,
            max_num_batched_tokens=16,
            num_host_blocks=num_host_blocks,
            kv_bytes_per_block=1000,
        )
    )
    fake_kv = FakeKV(scheduler)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(8, 13))] for _ in range(4)]
    num_steps = 0
    for i in range(40):
        if i % 4 == 0:  # arrivals in waves, so prefixes are evicted between their uses
            for _ in range(30):
                if not scheduler.has_unfinished_requests():
                    break
                plan = scheduler.schedule()
                fake_kv.run(plan)
                scheduler.update(plan, fake_result(plan, lambda rid: rng.randrange(1, 50)))
                num_steps += 1
        prompt = rng.choice(prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 12)))
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        fake_kv.run(plan)
        scheduler.update(plan, fake_result(plan, lambda rid: rng.randrange(1, 50)))
        num_steps += 1
        assert num_steps < 3000
    stats = scheduler.swap_stats
    assert stats.num_host_hit_tokens > 0 and stats.num_host_stored_blocks > 0
    assert stats.num_host_hit_tokens == stats.num_host_loaded_blocks * 4
    assert fake_kv.num_out == stats.num_swap_out_blocks + stats.num_host_stored_blocks
    assert fake_kv.num_in == stats.num_swap_in_blocks + stats.num_host_loaded_blocks
    assert stats.num_host_cache_bytes == 1000 * (
        stats.num_host_stored_blocks + stats.num_host_loaded_blocks
    )
    assert scheduler.num_free_blocks == 12
    host = scheduler.host
    assert host.num_free_blocks == num_host_blocks and host.num_used_blocks == 0
    assert 0 < host.num_cached_blocks <= num_host_blocks
