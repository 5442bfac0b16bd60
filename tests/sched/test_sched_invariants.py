"""Scheduler invariants on a random workload: same outputs with or without preemption/caching.

The fake runner is a pure function of each sequence (its next token depends only on the tokens
so far), so every request must produce the same tokens however it was batched, chunked,
preempted or served from the prefix cache.
"""

from __future__ import annotations

import random

from sits.core.plan import StepPlan, StepResult
from sits.kvcache import cdiv
from sits.sched import Scheduler
from tests.sched.sched_testlib import make_config, make_request


class PureRunner:
    """A fake runner with a fake paged KV cache (one token id per slot).

    It checks each plan against its own copy of the sequences, writes the step's tokens into
    their slots, reads every scheduled sequence back through its block table (so a prefix hit
    on a wrong or overwritten block is caught), then samples f(sequence).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.prompts: dict[str, list[int]] = {}
        self.num_new_requests: dict[str, int] = {}
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> token id

    def run(self, plan: StepPlan) -> StepResult:
        for new in plan.new_requests:
            count = self.num_new_requests.get(new.request_id, 0)
            self.num_new_requests[new.request_id] = count + 1
            self.prompts[new.request_id] = list(new.prompt_token_ids)
        for scheduled in plan.scheduled:  # every write of the step before any read
            for index, token in enumerate(scheduled.token_ids):
                self.slots[self._slot(scheduled.block_ids, scheduled.start_position + index)] = (
                    token
                )
        result = StepResult()
        for scheduled in plan.scheduled:
            sequence = self.prompts[scheduled.request_id] + list(scheduled.output_token_ids)
            end = scheduled.start_position + scheduled.num_tokens
            assert scheduled.token_ids == sequence[scheduled.start_position : end]
            cached = [self.slots.get(self._slot(scheduled.block_ids, p)) for p in range(end)]
            assert cached == sequence[:end], scheduled.request_id
            assert scheduled.sample == (end == len(sequence))
            if scheduled.sample:
                token = (sum(sequence) * 7 + len(sequence)) % 1000 + 1000
                result.sampled_token_ids[scheduled.request_id] = token
        return result

    def _slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        return block_ids[position // self.block_size], position % self.block_size


def make_workload(seed: int) -> list[tuple[int, object]]:
    """(step at which to add, request) pairs; some groups share a prompt via a leader."""
    rng = random.Random(seed)
    workload = []
    for index in range(30):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 40))]
        step = rng.randrange(0, 40)
        group = rng.choice([1, 1, 3])
        for sample in range(group):
            request_id = f"r{index}-{sample}"
            leader = f"r{index}-0" if sample else None
            request = make_request(
                request_id,
                prompt,
                max_tokens=rng.randint(1, 30),
                arrival_time=float(index),
                prefix_leader_id=leader,
            )
            workload.append((step, request))
    return workload


def check_block_accounting(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    users: dict[int, int] = {}
    for request_id in scheduler.running_request_ids():
        request = scheduler.get_request(request_id)
        table = scheduler.kv.get_block_ids(request_id)
        assert len(table) == cdiv(request.num_computed_tokens, scheduler.config.block_size)
        for block_id in table:
            users[block_id] = users.get(block_id, 0) + 1
    for block_id in range(1, pool.num_blocks):
        assert pool.ref_count(block_id) == users.get(block_id, 0)
    assert pool.num_free_blocks == pool.num_usable_blocks - len(users)
    for request_id in scheduler.waiting_request_ids():
        assert scheduler.kv.get_block_ids(request_id) == []


def run_workload(scheduler: Scheduler, seed: int) -> tuple[dict[str, list[int]], int]:
    """Run to completion; returns (outputs per request, total preemptions)."""
    workload = make_workload(seed)
    runner = PureRunner(scheduler.config.block_size)
    requests = [request for _, request in workload]
    config = scheduler.config
    for step in range(10_000):
        for add_step, request in workload:
            if add_step == step:
                scheduler.add_request(request)
        if step >= 40 and not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(plan.scheduled) <= config.max_num_seqs
        for scheduled in plan.scheduled:
            end = scheduled.start_position + scheduled.num_tokens
            assert len(scheduled.block_ids) == cdiv(end, config.block_size)
        scheduler.update(plan, runner.run(plan))
        check_block_accounting(scheduler)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    assert set(runner.num_new_requests.values()) == {1}  # sent once per request life
    for request in requests:
        assert request.num_output_tokens == request.max_tokens
    outputs = {r.request_id: list(r.output_token_ids) for r in requests}
    return outputs, sum(r.num_preemptions for r in requests)


def test_same_outputs_with_and_without_preemption_and_caching() -> None:
    roomy = Scheduler(make_config(num_blocks=2000, max_num_batched_tokens=4096, max_num_seqs=256))
    reference, roomy_preemptions = run_workload(roomy, seed=0)
    assert roomy_preemptions == 0
    tight = Scheduler(make_config(num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6))
    outputs, tight_preemptions = run_workload(tight, seed=0)
    assert tight_preemptions > 0
    assert outputs == reference
    assert tight.prefix_cache_stats.num_hit_tokens > 0
    no_cache = Scheduler(
        make_config(num_blocks=24, max_num_batched_tokens=16, enable_prefix_caching=False)
    )
    outputs, _ = run_workload(no_cache, seed=0)
    assert outputs == reference
    assert no_cache.prefix_cache_stats.num_query_tokens == 0
