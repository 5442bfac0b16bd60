"""Scheduler outputs carry each request field in its `EngineCoreOutput` field (the hot path
builds them positionally)."""

from __future__ import annotations

from sits.core.outputs import EngineCoreOutput
from sits.core.request import FinishReason
from sits.sched import Scheduler
from sits.sched.state import engine_output
from tests.sched.sched_testlib import logprobs_of, make_config, make_request, run_step


def test_engine_output_fields() -> None:
    request = make_request("r", [1, 2, 3], 4)
    request.num_cached_tokens = 8
    request.finish_reason = FinishReason.STOP
    request.stop_reason = 9
    prompt_logprobs = [None, logprobs_of(2)]
    out = engine_output(request, [9], [logprobs_of(9)], prompt_logprobs)
    assert out == EngineCoreOutput(
        request_id="r",
        new_token_ids=[9],
        new_logprobs=[logprobs_of(9)],
        new_prompt_logprobs=prompt_logprobs,
        finish_reason=FinishReason.STOP,
        stop_reason=9,
        num_cached_tokens=8,
    )
    request.num_cached_tokens = -1  # never scheduled: reported as 0
    assert engine_output(request, [], None, None).num_cached_tokens == 0


def test_decode_steps_report_tokens_and_stop() -> None:
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("a", [1, 2, 3], 3, stop_token_ids=[8]))
    scheduler.add_request(make_request("b", [4, 5], 2))
    tokens = iter([7, 7, 8, 7])  # a: 7, 8 (stop); b: 7, 7 (length)
    steps = [run_step(scheduler, lambda _: next(tokens))[1] for _ in range(2)]
    assert [
        [(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason) for o in s] for s in steps
    ] == [
        [("a", [7], None, None), ("b", [7], None, None)],
        [("a", [8], FinishReason.STOP, 8), ("b", [7], FinishReason.LENGTH, None)],
    ]
    assert not scheduler.has_unfinished_requests()
