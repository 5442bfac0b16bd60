"""Scheduler: prefix-cache hits skip cached tokens; n>1 siblings wait for their prefix leader."""

from __future__ import annotations

import pytest

from sits.core.request import FinishReason
from sits.sched import Scheduler
from tests.sched.sched_testlib import (
    make_config,
    make_request,
    run_step,
    run_to_completion,
    summary,
)

PROMPT = list(range(10))


def test_siblings_wait_for_the_leader_then_compute_only_the_tail() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("L", PROMPT, max_tokens=4))
    scheduler.add_request(make_request("S1", PROMPT, max_tokens=2, prefix_leader_id="L"))
    scheduler.add_request(make_request("S2", PROMPT, max_tokens=2, prefix_leader_id="L"))
    scheduler.add_request(make_request("X", [50, 51], max_tokens=2))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("L", 0, 10, True), ("X", 0, 2, True)]  # X passes the siblings
    assert scheduler.waiting_request_ids() == ["S1", "S2"]
    plan, outputs = run_step(scheduler)
    assert summary(plan) == [
        ("L", 10, 1, True),
        ("X", 2, 1, True),
        ("S1", 8, 2, True),
        ("S2", 8, 2, True),
    ]
    assert [s.block_ids for s in plan.scheduled] == [[1, 2, 3], [4], [1, 2, 5], [1, 2, 6]]
    assert scheduler.kv.pool.ref_count(1) == 3
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {
        "L": 0,
        "X": 0,
        "S1": 8,
        "S2": 8,
    }
    stats = scheduler.prefix_cache_stats
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (10 + 2 + 10 + 10, 16)
    run_to_completion(scheduler)
    assert scheduler.num_free_blocks == scheduler.num_total_blocks


def test_siblings_wait_through_a_chunked_leader_prefill() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=4))
    scheduler.add_request(make_request("L", PROMPT, max_tokens=2))
    scheduler.add_request(make_request("S1", PROMPT, max_tokens=2, prefix_leader_id="L"))
    assert summary(run_step(scheduler)[0]) == [("L", 0, 4, False)]
    assert summary(run_step(scheduler)[0]) == [("L", 4, 4, False)]
    assert summary(run_step(scheduler)[0]) == [("L", 8, 2, True)]  # S1 still waits
    assert summary(run_step(scheduler)[0]) == [("L", 10, 1, True), ("S1", 8, 2, True)]


def test_siblings_of_a_finished_leader_run_without_waiting() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("L", PROMPT, max_tokens=2))
    scheduler.add_request(make_request("S1", PROMPT, max_tokens=2, prefix_leader_id="L"))
    scheduler.finish_requests(["L"], FinishReason.ABORT)
    assert summary(run_step(scheduler)[0]) == [("S1", 0, 10, True)]


def test_without_a_leader_identical_prompts_all_compute_everything() -> None:
    scheduler = Scheduler(make_config())
    for request_id in ("A", "B"):
        scheduler.add_request(make_request(request_id, PROMPT, max_tokens=2))
    assert summary(run_step(scheduler)[0]) == [("A", 0, 10, True), ("B", 0, 10, True)]


@pytest.mark.parametrize(
    ("caching", "salt", "prompt_logprobs", "expected_start"),
    [
        (True, None, None, 8),
        (False, None, None, 0),
        (True, "other-tenant", None, 0),
        (True, None, 1, 0),
    ],
)
def test_prefix_cache_hit_skips_cached_tokens(
    caching: bool, salt: str | None, prompt_logprobs: int | None, expected_start: int
) -> None:
    scheduler = Scheduler(make_config(enable_prefix_caching=caching))
    scheduler.add_request(make_request("A", PROMPT, max_tokens=1))
    run_to_completion(scheduler)
    request = make_request(
        "B", PROMPT + [77], max_tokens=1, cache_salt=salt, prompt_logprobs=prompt_logprobs
    )
    scheduler.add_request(request)
    plan, [output] = run_step(scheduler)
    assert summary(plan) == [("B", expected_start, 11 - expected_start, True)]
    assert plan.scheduled[0].token_ids == (PROMPT + [77])[expected_start:]
    assert output.num_cached_tokens == request.num_cached_tokens == expected_start


def test_identical_prompt_recomputes_its_last_block() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("A", list(range(12)), max_tokens=1))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("B", list(range(12)), max_tokens=1))
    plan, _ = run_step(scheduler)
    assert summary(plan) == [("B", 8, 4, True)]
    assert plan.scheduled[0].block_ids == [1, 2, 4]
