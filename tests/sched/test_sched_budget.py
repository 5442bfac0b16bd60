"""Scheduler: token budget, chunked prefill, max_num_seqs, decode-first order, plan messages."""

from __future__ import annotations

from sits.core.request import FinishReason, RequestStatus
from sits.sched import Scheduler
from tests.sched.sched_testlib import make_config, make_request, run_step, summary


def test_chunked_prefill_under_a_budget_of_seven() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=7))
    scheduler.add_request(make_request("A", list(range(10)), max_tokens=3))
    scheduler.add_request(make_request("B", list(range(20, 25)), max_tokens=3))

    plan, outputs = run_step(scheduler)
    assert summary(plan) == [("A", 0, 7, False)]
    assert [n.request_id for n in plan.new_requests] == ["A"]
    assert plan.scheduled[0].token_ids == list(range(7))
    assert outputs == []  # a non-final chunk produces nothing

    plan, outputs = run_step(scheduler)
    assert summary(plan) == [("A", 7, 3, True), ("B", 0, 4, False)]
    assert [n.request_id for n in plan.new_requests] == ["B"]
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("A", [7])]

    scheduler.add_request(make_request("C", list(range(30, 42)), max_tokens=3))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("A", 10, 1, True), ("B", 4, 1, True), ("C", 0, 5, False)]
    assert plan.scheduled[0].token_ids == [7]  # the token sampled last step

    plan, outputs = run_step(scheduler)
    assert summary(plan) == [("A", 11, 1, True), ("B", 5, 1, True), ("C", 5, 5, False)]
    assert outputs[0].finish_reason is FinishReason.LENGTH and outputs[0].request_id == "A"

    plan, _ = run_step(scheduler)
    assert summary(plan) == [("B", 6, 1, True), ("C", 10, 2, True)]
    assert plan.finished_request_ids == ["A"]
    assert plan.new_requests == []

    plan, _ = run_step(scheduler)
    assert summary(plan) == [("C", 12, 1, True)]
    assert plan.finished_request_ids == ["B"]
    plan, outputs = run_step(scheduler)
    assert summary(plan) == [("C", 13, 1, True)]
    assert outputs[0].finished and not scheduler.has_unfinished_requests()
    plan = scheduler.schedule()
    assert plan.is_empty and plan.finished_request_ids == ["C"]
    assert scheduler.num_free_blocks == scheduler.num_total_blocks == 63


def test_long_prefill_continues_before_waiting_and_chunks_can_be_one_token() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=7))
    scheduler.add_request(make_request("A", list(range(20)), max_tokens=2))
    scheduler.add_request(make_request("B", list(range(50, 53)), max_tokens=2))
    assert summary(run_step(scheduler)[0]) == [("A", 0, 7, False)]
    assert summary(run_step(scheduler)[0]) == [("A", 7, 7, False)]
    assert summary(run_step(scheduler)[0]) == [("A", 14, 6, True), ("B", 0, 1, False)]
    assert summary(run_step(scheduler)[0]) == [("A", 20, 1, True), ("B", 1, 2, True)]


def test_decodes_first_and_budget_exhausted_by_running_requests() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=2))
    scheduler.add_request(make_request("A", [1], max_tokens=5))
    scheduler.add_request(make_request("B", [2], max_tokens=5))
    assert summary(run_step(scheduler)[0]) == [("A", 0, 1, True), ("B", 0, 1, True)]
    scheduler.add_request(make_request("C", [3, 4, 5], max_tokens=5))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("A", 1, 1, True), ("B", 1, 1, True)]
    assert scheduler.get_request("C").status is RequestStatus.WAITING
    assert scheduler.num_waiting == 1 and scheduler.num_running == 2


def test_max_num_seqs_limits_running_requests() -> None:
    scheduler = Scheduler(make_config(max_num_seqs=2))
    for request_id in "ABC":
        scheduler.add_request(make_request(request_id, [1, 2, 3], max_tokens=2))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("A", 0, 3, True), ("B", 0, 3, True)]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    plan, outputs = run_step(scheduler)
    assert summary(plan) == [("A", 3, 1, True), ("B", 3, 1, True)]
    assert [o.finish_reason for o in outputs] == [FinishReason.LENGTH] * 2
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("C", 0, 3, True)]
    assert plan.finished_request_ids == ["A", "B"]


def test_scheduled_request_carries_block_table_and_outputs() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("A", list(range(6)), max_tokens=4))
    plan, _ = run_step(scheduler)
    [scheduled] = plan.scheduled
    assert scheduled.block_ids == [1, 2]
    assert plan.new_requests[0].prompt_token_ids == list(range(6))
    for _ in range(2):
        run_step(scheduler)
    plan = scheduler.schedule()
    [scheduled] = plan.scheduled
    assert (scheduled.start_position, scheduled.token_ids) == (8, [7])
    assert scheduled.block_ids == [1, 2, 3]  # position 8 needs a third block
    assert scheduled.output_token_ids == [7, 7, 7]
    assert scheduler.kv_usage == 3 / 63


def test_queued_prefill_counts_waiting_tokens_and_the_prompt_left_of_running_requests() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=64))
    scheduler.add_request(make_request("a", list(range(1, 101)), arrival_time=1.0))
    assert scheduler.queued_prefill() == {"default": (1.0, 100)}
    run_step(scheduler)  # a runs with 64 of its 100 prompt tokens computed
    scheduler.add_request(make_request("b", [7] * 20, arrival_time=5.0, tenant_id="x"))
    scheduler.add_request(make_request("c", [8] * 10, arrival_time=4.0, tenant_id="x"))
    assert scheduler.queued_prefill() == {"default": (None, 36), "x": (4.0, 30)}
    run_step(scheduler)  # a's last 36 tokens, then b and c's prompts (28 of the 30)
    assert scheduler.queued_prefill() == {"x": (None, 2)}
