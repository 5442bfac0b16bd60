"""Scheduler: preemption by recompute when KV blocks run out (victim choice, resume, counts)."""

from __future__ import annotations

import itertools

from sits.core.request import FinishReason, RequestStatus
from sits.sched import Scheduler
from tests.sched.sched_testlib import fake_result, make_config, make_request, run_step, summary


def counting_tokens():
    """A token_of callback that samples 101, 102, ... in order of calls."""
    counter = itertools.count(101)
    return lambda request_id: next(counter)


def test_latest_arrived_is_preempted_then_resumes_and_finishes() -> None:
    # 4 usable blocks of 4 tokens; A and B each grow to 3 blocks, so both cannot run at once.
    scheduler = Scheduler(make_config(num_blocks=5, enable_prefix_caching=False))
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    token_of = counting_tokens()
    plans = [run_step(scheduler, token_of)[0] for _ in range(5)]
    assert summary(plans[0]) == [("A", 0, 4, True), ("B", 0, 4, True)]
    assert summary(plans[4]) == [("A", 7, 1, True), ("B", 7, 1, True)]
    assert plans[4].scheduled[0].block_ids == [1, 3] and plans[4].scheduled[1].block_ids == [2, 4]
    b = scheduler.get_request("B")
    assert b.output_token_ids == [102, 104, 106, 108, 110]

    # Step 6: A needs a third block; B (latest arrival, not yet scheduled) is preempted.
    plan = scheduler.schedule()
    assert summary(plan) == [("A", 8, 1, True)]
    assert plan.scheduled[0].block_ids == [1, 3, 4]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.WAITING, 0, 1)
    assert b.output_token_ids == [102, 104, 106, 108, 110]  # outputs are kept
    assert scheduler.num_free_blocks == 1 and scheduler.kv.get_block_ids("B") == []
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    scheduler.update(plan, fake_result(plan, token_of))

    # Steps 7-8: B cannot get 3 blocks while A runs; A finishes at step 8.
    assert summary(run_step(scheduler, token_of)[0]) == [("A", 9, 1, True)]
    plan, outputs = run_step(scheduler, token_of)
    assert summary(plan) == [("A", 10, 1, True)]
    assert outputs[0].finish_reason is FinishReason.LENGTH

    # Step 9: B recomputes prompt + its 5 outputs in one chunk and samples.
    plan, _ = run_step(scheduler, token_of)
    assert summary(plan) == [("B", 0, 9, True)]
    assert plan.scheduled[0].token_ids == [5, 6, 7, 8, 102, 104, 106, 108, 110]
    assert plan.scheduled[0].block_ids == [2, 4, 3]
    assert plan.new_requests == []  # the runner kept B's state
    assert plan.finished_request_ids == ["A"]
    run_step(scheduler, token_of)
    plan, outputs = run_step(scheduler, token_of)
    assert summary(plan) == [("B", 10, 1, True)]
    assert outputs[0].finish_reason is FinishReason.LENGTH
    assert b.output_token_ids == [102, 104, 106, 108, 110, 114, 115, 116]
    assert scheduler.num_free_blocks == 4 and not scheduler.has_unfinished_requests()
    assert scheduler.num_preemptions == 1


def test_request_preempts_itself_when_it_arrived_last() -> None:
    scheduler = Scheduler(make_config(num_blocks=5, enable_prefix_caching=False))
    # A runs first (added first) but arrived later than B.
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=2.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=1.0))
    for _ in range(5):
        run_step(scheduler)
    plan = scheduler.schedule()
    assert summary(plan) == [("B", 8, 1, True)]
    assert plan.scheduled[0].block_ids == [2, 4, 3]
    a = scheduler.get_request("A")
    assert (a.status, a.num_preemptions) == (RequestStatus.WAITING, 1)


def test_never_preempts_a_request_scheduled_in_the_same_step() -> None:
    scheduler = Scheduler(make_config(num_blocks=5, enable_prefix_caching=False))
    scheduler.add_request(make_request("A", [1, 2], max_tokens=8, arrival_time=3.0))
    scheduler.add_request(make_request("B", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("C", [1, 2, 3, 4], max_tokens=8, arrival_time=2.0))
    plan, _ = run_step(scheduler)
    assert [s.block_ids for s in plan.scheduled] == [[1], [2], [3]]
    # B takes the last free block; C needs one too. A arrived last but is already scheduled
    # this step, so C (the latest among the rest) preempts itself.
    plan = scheduler.schedule()
    assert summary(plan) == [("A", 2, 1, True), ("B", 4, 1, True)]
    assert plan.scheduled[1].block_ids == [2, 4]
    c = scheduler.get_request("C")
    assert (c.status, c.num_preemptions, c.num_computed_tokens) == (RequestStatus.WAITING, 1, 0)
    assert scheduler.get_request("A").num_preemptions == 0


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = Scheduler(make_config(num_blocks=5, enable_prefix_caching=False))
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    for _ in range(5):
        run_step(scheduler)
    scheduler.add_request(make_request("D", [9], max_tokens=1, arrival_time=3.0))
    plan = scheduler.schedule()  # preempts B; D would fit in the free block but waits
    assert summary(plan) == [("A", 8, 1, True)]
    assert scheduler.waiting_request_ids() == ["B", "D"]
    assert scheduler.running_request_ids() == ["A"]


def test_preempted_request_rehits_its_cached_blocks() -> None:
    scheduler = Scheduler(make_config(num_blocks=6))  # 5 usable blocks
    scheduler.add_request(make_request("A", [1, 2, 3, 4], max_tokens=8, arrival_time=1.0))
    scheduler.add_request(make_request("B", [5, 6, 7, 8], max_tokens=8, arrival_time=2.0))
    for _ in range(5):
        run_step(scheduler)  # A: [1, 3], B: [2, 4], block 5 free
    plan = scheduler.schedule()  # A takes block 5; B needs a block and preempts itself
    assert summary(plan) == [("A", 8, 1, True)]
    b = scheduler.get_request("B")
    assert b.num_preemptions == 1
    assert scheduler.kv.pool.free_block_ids() == [4, 2]  # B's full blocks stay cached
    scheduler.update(plan, fake_result(plan))
    # B's hits would take both free blocks, leaving none for its last token: it waits.
    assert summary(run_step(scheduler)[0]) == [("A", 9, 1, True)]
    plan, outputs = run_step(scheduler)
    assert summary(plan) == [("A", 10, 1, True)] and outputs[0].finished
    plan, _ = run_step(scheduler)
    # B has 4 prompt + 5 output tokens; its two full computed blocks hit the cache.
    assert summary(plan) == [("B", 8, 1, True)]
    assert plan.scheduled[0].block_ids == [2, 4, 5]
    assert b.num_cached_tokens == 0  # set on first schedule only
    stats = scheduler.prefix_cache_stats
    assert (stats.num_requests, stats.num_query_tokens, stats.num_hit_tokens) == (3, 17, 8)
