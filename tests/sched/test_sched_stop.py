"""Scheduler: stop conditions, logprob pass-through, aborts and requests that can never fit."""

from __future__ import annotations

import pytest

from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.request import FinishReason, RequestStatus
from sits.sched import Scheduler, check_stop
from tests.sched.sched_testlib import (
    fake_result,
    logprobs_of,
    make_config,
    make_request,
    run_step,
    run_to_completion,
    summary,
)


def scripted(tokens: dict[str, list[int]]):
    """token_of callback sampling each request's scripted tokens in order."""
    iterators = {request_id: iter(seq) for request_id, seq in tokens.items()}
    return lambda request_id: next(iterators[request_id])


def finish_of(request, sampled: list[int]) -> tuple[list[int], FinishReason, object]:
    """Run one request alone with scripted tokens; (outputs, finish_reason, stop_reason)."""
    scheduler = Scheduler(make_config())
    scheduler.add_request(request)
    finished = run_to_completion(scheduler, token_of=scripted({request.request_id: sampled}))
    output = finished[request.request_id]
    assert request.status is RequestStatus.FINISHED and scheduler.num_free_blocks == 63
    return request.output_token_ids, output.finish_reason, output.stop_reason


def test_eos_stops_with_no_stop_reason() -> None:
    request = make_request("r", [1, 2, 3], max_tokens=10, eos_token_id=2)
    assert finish_of(request, [5, 2, 6]) == ([5, 2], FinishReason.STOP, None)


def test_stop_token_id_is_the_stop_reason() -> None:
    request = make_request("r", [1, 2, 3], max_tokens=10, eos_token_id=2, stop_token_ids=[9])
    assert finish_of(request, [5, 9, 6]) == ([5, 9], FinishReason.STOP, 9)


def test_min_tokens_defers_eos_and_stop_ids() -> None:
    request = make_request("r", [1], max_tokens=10, eos_token_id=2, min_tokens=3)
    assert finish_of(request, [2, 2, 2, 4]) == ([2, 2, 2], FinishReason.STOP, None)
    request = make_request("s", [1], max_tokens=10, stop_token_ids=[9], min_tokens=2)
    assert finish_of(request, [9, 9, 4]) == ([9, 9], FinishReason.STOP, 9)


def test_ignore_eos_runs_to_max_tokens_but_stop_ids_still_stop() -> None:
    request = make_request("r", [1], max_tokens=4, eos_token_id=2, ignore_eos=True)
    assert finish_of(request, [2, 2, 2, 2, 2]) == ([2, 2, 2, 2], FinishReason.LENGTH, None)
    request = make_request(
        "s", [1], max_tokens=4, eos_token_id=2, ignore_eos=True, stop_token_ids=[2]
    )
    assert finish_of(request, [3, 2, 5]) == ([3, 2], FinishReason.STOP, 2)


def test_max_tokens_and_max_model_len_give_length() -> None:
    request = make_request("r", [1, 2], max_tokens=3, eos_token_id=2)
    assert finish_of(request, [4, 5, 6, 7]) == ([4, 5, 6], FinishReason.LENGTH, None)
    long_request = make_request("t", list(range(6)), max_tokens=100)
    long_request.append_output_token(1)
    assert check_stop(long_request, max_model_len=8) is None
    long_request.append_output_token(1)
    assert check_stop(long_request, max_model_len=8) == (FinishReason.LENGTH, None)


def test_logprobs_and_prompt_logprobs_are_passed_through() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=3))
    scheduler.add_request(make_request("r", [1, 2, 3, 4, 5], max_tokens=1, logprobs=0))
    plan = scheduler.schedule()
    assert summary(plan) == [("r", 0, 3, False)]
    result = fake_result(plan)
    result.prompt_logprobs["r"] = [None, logprobs_of(2), logprobs_of(3)]
    [output] = scheduler.update(plan, result)  # no token, but prompt logprobs
    assert (output.new_token_ids, output.new_prompt_logprobs) == ([], result.prompt_logprobs["r"])
    assert not output.finished
    plan = scheduler.schedule()
    result = fake_result(plan)
    result.logprobs["r"] = logprobs_of(7)
    [output] = scheduler.update(plan, result)
    assert output.new_token_ids == [7] and output.new_logprobs == [logprobs_of(7)]
    assert output.finish_reason is FinishReason.LENGTH


def test_max_tokens_zero_computes_the_prompt_without_sampling() -> None:
    scheduler = Scheduler(make_config())
    request = make_request("r", [1, 2, 3], max_tokens=0, prompt_logprobs=1)
    scheduler.add_request(request)
    plan = scheduler.schedule()
    assert summary(plan) == [("r", 0, 3, False)]
    [output] = scheduler.update(plan, fake_result(plan))
    assert output.finish_reason is FinishReason.LENGTH and output.new_token_ids == []
    assert scheduler.num_free_blocks == 63


def test_abort_frees_every_block_and_tells_the_runner_once() -> None:
    scheduler = Scheduler(make_config(max_num_batched_tokens=8))
    start_free_blocks = scheduler.num_free_blocks
    scheduler.add_request(make_request("A", list(range(10)), max_tokens=8))
    scheduler.add_request(make_request("B", list(range(20, 26)), max_tokens=8))
    scheduler.add_request(make_request("C", [1], max_tokens=8))
    run_step(scheduler)
    run_step(scheduler)  # A and B are running, C waits for budget
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    assert scheduler.num_free_blocks == start_free_blocks - 5
    outputs = scheduler.finish_requests(["A", "C", "nope"], FinishReason.ABORT)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("A", FinishReason.ABORT),
        ("C", FinishReason.ABORT),
    ]
    assert scheduler.finish_requests("A", FinishReason.ABORT) == []  # already finished
    assert scheduler.get_request("A") is None
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ["A"]  # the runner never saw C
    # B was scheduled and is aborted before update: the step's result for it is dropped.
    [stop_output] = scheduler.finish_requests(["B"], FinishReason.STOP, stop_reason="END")
    assert stop_output.stop_reason == "END"
    assert scheduler.update(plan, fake_result(plan)) == []
    assert scheduler.num_free_blocks == start_free_blocks
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ["B"]


def test_requests_that_can_never_fit_raise_at_once() -> None:
    scheduler = Scheduler(make_config(num_blocks=5, max_model_len=20))  # 16 tokens of KV
    with pytest.raises(PromptTooLongError, match=r"maximum context length is 20 tokens") as info:
        scheduler.add_request(make_request("long", list(range(18)), max_tokens=4))
    assert "22 tokens (18 in the prompt, 4 for the completion)" in str(info.value)
    assert info.value.param == "prompt"
    with pytest.raises(PromptTooLongError, match=r"= 5 KV blocks of 4 tokens.* only 4 blocks"):
        scheduler.add_request(make_request("big", list(range(14)), max_tokens=4))
    with pytest.raises(InvalidParameterError) as empty:
        scheduler.add_request(make_request("empty", [], max_tokens=4))
    assert empty.value.param == "prompt"
    assert not scheduler.has_unfinished_requests()

    scheduler.add_request(make_request("fits", list(range(12)), max_tokens=4))
    with pytest.raises(InvalidParameterError) as duplicate:
        scheduler.add_request(make_request("fits", [1], max_tokens=4))
    assert duplicate.value.param == "request_id"
    scheduler.add_request(make_request("small", [1, 2], max_tokens=2))
    finished = run_to_completion(scheduler)
    assert {k: v.finish_reason for k, v in finished.items()} == {
        "fits": FinishReason.LENGTH,
        "small": FinishReason.LENGTH,
    }
    assert scheduler.num_free_blocks == 4
