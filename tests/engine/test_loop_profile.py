"""The engine loop's profile: exact window figures from a fake clock and fake core counters; the
core's counters on the tiny model (decode rows, prompt tokens wasted by an abort); and the
core's start deadlines (requests never started by then are dropped)."""

from __future__ import annotations

import logging
import time

import pytest

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.core.request import START_DEADLINE_MISSED, FinishReason
from sits.core.sampling_params import SamplingParams
from sits.engine.builder import build_engine
from sits.engine.core import EngineCore
from sits.engine.output_processor import make_engine_requests
from sits.engine.stats import LoopProfile, StepStats


class _Core:
    def __init__(self) -> None:
        self.stats = StepStats()
        self.scheduler = type("Scheduler", (), {"num_preemptions": 0})()


def _profile(
    start_s: float, period_s: float, runner: object = None
) -> tuple[list[float], _Core, LoopProfile]:
    """(a settable clock at `start_s`, a fake core with `runner` if given, its profile)."""
    clock = [start_s]
    core = _Core()
    if runner is not None:
        core.runner = runner
    return clock, core, LoopProfile(core, period_s=period_s, clock=lambda: clock[0])


def test_window_line_gives_ms_per_step_of_each_phase(caplog) -> None:
    clock, core, profile = _profile(100.0, period_s=2.0)
    assert profile.maybe_log() is None  # no time has passed
    # 4 steps in 2 s: 0.5 s of runner, 0.125 s of schedule and update each, per 4 steps.
    core.stats.num_steps, core.stats.num_decode_rows, core.stats.num_prefill_tokens = 4, 400, 1024
    core.stats.num_prefill_chunks = 6
    core.stats.phase_s.update(schedule=0.125, runner=0.5, update=0.125)
    core.stats.num_wasted_prefill_tokens = 512
    core.scheduler.num_preemptions = 3
    for phase, seconds in (("step", 0.75), ("commands", 0.25), ("stats", 0.125), ("send", 0.25)):
        profile.add(phase, seconds)
    clock[0] = 101.5
    assert profile.maybe_log() is None  # the window is not over
    clock[0] = 102.0
    with caplog.at_level(logging.DEBUG, logger="sits.engine.stats"):
        line = profile.maybe_log()
    assert line == (
        "engine loop, last 2.0 s (busy 1.4 s): 4 steps of 343.8 ms: step 187.5 (schedule "
        "31.2, runner 125.0, update 31.2), commands 62.5, stats 31.2, send 62.5; per step "
        "100.0 decodes + 256.0 prefill tokens in 1.5 chunks; 3 preemptions; 512 prefill "
        "tokens of requests shed before their first token"
    )
    assert caplog.messages == [line]
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]  # not INFO: no operator acts
    # The next window starts from zero; one without steps logs nothing.
    clock[0] = 104.0
    assert profile.maybe_log() is None
    core.stats.num_steps = 5
    profile.add("step", 0.5)
    clock[0] = 106.0
    core.scheduler.num_preemptions = 4
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sits.engine.stats"):
        line = profile.maybe_log()
    assert caplog.messages == []  # an operator at the default level sees no line every 10 s
    assert "(busy 0.5 s): 1 step of 500.0 ms: step 500.0 (schedule 0.0" in line
    assert "; 1 preemption; " in line


def test_a_runner_with_counters_splits_its_phase_and_counts_rows_run() -> None:
    runner = type(
        "Runner", (), {"phase_s": {"launch": 0.0, "shadow": 0.0, "sync": 0.0}, "num_rows_run": 0}
    )()
    clock, core, profile = _profile(100.0, period_s=1.0, runner=runner)
    core.stats.num_steps, core.stats.num_decode_rows, core.stats.num_prefill_tokens = 2, 200, 900
    core.stats.num_prefill_chunks = 3
    core.stats.phase_s.update(runner=0.0625)
    core.runner.phase_s.update(launch=0.00390625, shadow=0.0078125, sync=0.05078125)
    core.runner.num_rows_run = 1280 + 1152  # two mixed steps, padded to their graphs
    profile.add("step", 0.0625)
    clock[0] = 101.0
    line = profile.maybe_log()
    assert "runner 31.2 [launch 2.0, shadow 3.9, sync 25.4], update 0.0)" in line
    assert "per step 100.0 decodes + 450.0 prefill tokens in 1.5 chunks, 1216.0 rows run;" in line


def test_laps_time_consecutive_phases_from_a_mark() -> None:
    clock, core, profile = _profile(10.0, period_s=1.0)
    profile.mark()
    for phase, end_s in (("step", 10.25), ("stats", 10.375), ("send", 10.5)):
        clock[0] = end_s
        profile.lap(phase)
    core.stats.num_steps = 1
    clock[0] = 11.0
    assert "(busy 0.5 s): 1 step of 500.0 ms: step 250.0 " in profile.maybe_log()


def test_period_must_be_positive() -> None:
    with pytest.raises(InvalidParameterError, match="must be > 0, got 0") as info:
        LoopProfile(_Core(), period_s=0)
    assert info.value.param == "period_s"


def _tiny_core(tiny_model_factory, max_num_seqs: int) -> EngineCore:
    """The tiny llama on the CPU, a budget of 64 tokens per step."""
    config = EngineConfig(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
    )
    return build_engine(config).core


def _add(
    core: EngineCore, request_id: str, length: int, max_tokens: int, deadline_s: float | None = None
) -> None:
    """Queue a greedy request with a prompt of `length` tokens 1..length."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    (request,) = make_engine_requests(
        request_id,
        list(range(1, length + 1)),
        params,
        eos_token_ids=(),
        max_model_len=256,
        enable_prefix_caching=False,
        start_deadline_s=deadline_s,
    )
    core.add_request(request)


def test_core_counts_decode_rows_and_prompt_tokens_lost_to_an_abort(tiny_model_factory) -> None:
    core = _tiny_core(tiny_model_factory, max_num_seqs=4)
    for request_id, length in (("a", 40), ("b", 100)):
        _add(core, request_id, length, max_tokens=3)
    core.step()  # a: 40 prompt tokens (first token), b: 24 of 100
    core.step()  # a: one decode, b: 63 more (87 of 100: the budget is 64 tokens)
    stats = core.stats
    assert (stats.num_steps, stats.num_decode_rows, stats.num_prefill_tokens) == (2, 1, 127)
    assert stats.num_prefill_chunks == 3  # a; b; b (a's decode is no chunk)
    assert core.runner.num_rows_run == 64 + 64  # eager on the CPU: no padding
    core.finish_requests(["b"], FinishReason.ABORT)  # shed before its first token
    core.finish_requests(["a"], FinishReason.ABORT)  # had tokens: nothing wasted
    assert core.stats.num_wasted_prefill_tokens == 87
    assert all(seconds > 0 for seconds in core.stats.phase_s.values())


def test_requests_past_their_start_deadline_are_dropped_only_if_never_started(
    tiny_model_factory,
) -> None:
    """`Request.start_deadline_s`: a waiting request untouched at its deadline ends (ABORT,
    `START_DEADLINE_MISSED`, no tokens, nothing computed); one whose prefill has begun runs
    on, and so does one without a deadline."""
    core = _tiny_core(tiny_model_factory, max_num_seqs=2)

    def add(request_id: str, length: int, deadline_s: float | None) -> None:
        _add(core, request_id, length, max_tokens=2, deadline_s=deadline_s)

    add("long", 100, time.monotonic() + 0.05)  # starts at once (64 of 100 tokens)
    add("slots", 10, None)  # takes the second sequence slot
    assert core.step() == []  # no first token yet
    assert core.scheduler.get_request("long").num_computed_tokens == 64
    add("late", 10, time.monotonic())  # due before the next step, and no slot is free
    add("free", 10, None)  # waits too, without a deadline
    time.sleep(0.06)  # "long" is past its deadline too, but has started
    outputs = core.step()
    dropped = [o for o in outputs if o.finished]
    assert [(o.request_id, o.finish_reason, o.stop_reason, o.new_token_ids) for o in dropped] == [
        ("late", FinishReason.ABORT, START_DEADLINE_MISSED, [])
    ]
    assert core.scheduler.get_request("late") is None
    assert core.scheduler.get_request("long").num_computed_tokens == 100  # ran on
    assert core.stats.num_wasted_prefill_tokens == 0  # nothing of "late" had been computed
    finished = set()
    while core.has_unfinished_requests():
        finished.update(o.request_id for o in core.step() if o.finished)
    assert finished == {"long", "slots", "free"}
