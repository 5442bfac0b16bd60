"""The step counters: exact figures of `StepStats` for hand-made plans and clock readings (no
model), the same bookkeeping both step paths run (`Stepper.account_step`)."""

from __future__ import annotations

import pytest

from sits.core.outputs import EngineCoreOutput
from sits.core.plan import ScheduledRequest, StepPlan
from sits.core.request import FinishReason
from sits.engine.stats import PrefillChunk, StepStats, prefills_of
from tests.sched.sched_testlib import make_request


def _plan() -> StepPlan:
    """'a' decodes (it has an output), 'b' computes a 6-token prompt chunk from position 4,
    'c' its first token's prompt (one token, no output yet: a prefill too)."""
    return StepPlan(
        scheduled=[
            ScheduledRequest("a", [9], 10, [0, 1, 2], True, [5]),
            ScheduledRequest("b", list(range(6)), 4, [3, 4, 5], False),
            ScheduledRequest("c", [1], 0, [6], True),
        ]
    )


def test_prefills_are_chunks_and_first_tokens_not_decodes() -> None:
    assert [sr.request_id for sr in prefills_of(_plan())] == ["b", "c"]


def test_a_step_counts_its_rows_tokens_phases_and_tenant_shares() -> None:
    stats = StepStats()
    plan = _plan()
    stats.note_scheduled(plan, start_s=1.0, scheduled_s=1.25)
    stats.account_step(
        plan,
        prefills_of(plan),
        {"gold": 3, "bulk": 5},
        step_s=2.0,
        busy_s=1.5,
        chunk_s=(1.25, 3.0),
        runner_s=1.0,
        update_s=0.5,
    )
    assert (stats.num_steps, stats.num_decode_rows) == (1, 1)
    assert (stats.num_prefill_tokens, stats.num_prefill_chunks) == (7, 2)
    assert stats.prefill_busy_s == 1.5 and stats.busy_s == 2.0
    assert stats.phase_s == {"schedule": 0.25, "runner": 1.0, "update": 0.5}
    assert stats.tenant_busy_s == {"gold": 0.75, "bulk": 1.25}
    assert stats.tenant_scheduled_tokens == {"gold": 3, "bulk": 5}
    assert list(stats.prefill_chunks) == [
        PrefillChunk("b", 1.25, 3.0, 4, 6),
        PrefillChunk("c", 1.25, 3.0, 0, 1),
    ]
    decode_only = StepPlan(scheduled=[ScheduledRequest("a", [9], 11, [0, 1, 2], True, [5, 9])])
    stats.account_step(decode_only, [], {"gold": 1}, 0.5, 0.5, (3.0, 3.5), 0.25, 0.25)
    assert (stats.num_steps, stats.num_decode_rows, stats.num_prefill_tokens) == (2, 2, 7)
    assert stats.prefill_busy_s == 1.5  # a decode-only step is no prefill time
    assert stats.tenant_busy_s == {"gold": 1.25, "bulk": 1.25}
    assert stats.busy_s == pytest.approx(sum(stats.tenant_busy_s.values()), rel=1e-12)


def test_only_representative_prefill_steps_count_toward_the_prefill_rate() -> None:
    """A step of fewer prompt tokens than `representative_prefill_tokens` adds to the plain
    prefill counters only; one of at least that many adds to both."""
    stats = StepStats(representative_prefill_tokens=8)
    small = _plan()  # 7 prompt tokens
    stats.account_step(small, prefills_of(small), {}, 2.0, 1.5, (1.0, 3.0), 1.0, 0.5)
    assert (stats.num_prefill_tokens, stats.prefill_busy_s) == (7, 1.5)
    assert (stats.num_full_prefill_tokens, stats.full_prefill_busy_s) == (0, 0.0)
    large = StepPlan(scheduled=[ScheduledRequest("d", list(range(8)), 0, [7], False)])
    stats.account_step(large, prefills_of(large), {}, 1.0, 0.25, (3.0, 4.0), 0.5, 0.5)
    assert (stats.num_prefill_tokens, stats.prefill_busy_s) == (15, 1.75)
    assert (stats.num_full_prefill_tokens, stats.full_prefill_busy_s) == (8, 0.25)


def test_outputs_carry_first_scheduled_times_once_and_recorded_chunks() -> None:
    stats = StepStats(record_request_chunks=True)
    plan = _plan()
    stats.note_scheduled(plan, 1.0, 1.25)
    stats.account_step(plan, prefills_of(plan), {}, 2.0, 1.5, (1.25, 3.0), 1.0, 0.5)
    outputs = [EngineCoreOutput("a", [7]), EngineCoreOutput("c", [8])]
    stats.annotate(outputs)
    assert [o.first_scheduled_time for o in outputs] == [1.25, 1.25]
    assert [o.prefill_chunks for o in outputs] == [None, [(3.0, 1)]]
    again = [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [])]
    stats.annotate(again)
    assert [o.first_scheduled_time for o in again] == [None, 1.25]  # once per request
    assert [o.prefill_chunks for o in again] == [None, [(3.0, 6)]]


def test_a_request_finished_from_outside_wastes_its_computed_prompt() -> None:
    stats = StepStats(record_request_chunks=True)
    plan = _plan()
    stats.note_scheduled(plan, 1.0, 1.25)
    stats.account_step(plan, prefills_of(plan), {}, 2.0, 1.5, (1.25, 3.0), 1.0, 0.5)
    b = make_request("b", list(range(16)))
    b.num_computed_tokens = 10
    stats.forget("b", b)
    done = make_request("a", list(range(16)))
    done.num_computed_tokens = 16
    done.append_output_token(5)
    stats.forget("a", done)  # had a token: nothing wasted
    stats.forget("gone", None)
    assert stats.num_wasted_prefill_tokens == 10
    outputs = [EngineCoreOutput("b", [], finish_reason=FinishReason.ABORT)]
    stats.annotate(outputs)
    assert (outputs[0].first_scheduled_time, outputs[0].prefill_chunks) == (None, None)
