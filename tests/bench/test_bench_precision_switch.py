"""`sits bench precision-switch`: the delay and period arithmetic on hand-made step records,
the failed / truncated request counts against a fake engine, and the whole benchmark on a
tiny random checkpoint on the CPU (exact switch, request and token counts)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from sits.bench.precision_switch import (
    LoadResult,
    StepRecord,
    SwitchCall,
    SwitchDelay,
    _one_request,
    per_precision,
    precision_periods,
    switch_delays,
)
from sits.cli.main import main


def _step(launched_s: float, ended_s: float, precision: str, n: int, tokens: int = 4):
    return StepRecord(launched_s, ended_s, precision, n, tokens)


# Steps of 1 s each, back to back; switch 1 called at 2.5 s while step 2 (launched 2.0) ran:
# step 3 (launched 3.0) is the first in fp8, no step in between. Switch 2 called at 4.2 s, but
# step 4 was launched at 4.3 s still in bf16 (the call had not reached the engine yet): one
# step in between, step 5 first in bf16. Switches 3 and 4 came with no step between them
# (3 never ran), switch 5 after the last step.
STEPS = [
    _step(0.0, 1.0, "bf16", 0, tokens=1),
    _step(1.0, 2.0, "bf16", 0),
    _step(2.0, 3.0, "bf16", 0),
    _step(3.0, 4.0, "fp8", 1, tokens=8),
    _step(4.3, 5.0, "fp8", 1, tokens=8),
    _step(5.0, 6.0, "bf16", 2),
    _step(6.0, 7.0, "bf16", 2),
    _step(7.5, 8.0, "bf16", 4),
]
CALLS = [
    SwitchCall(2.5, "fp8", 1),
    SwitchCall(4.2, "bf16", 2),
    SwitchCall(7.1, "fp8", 3),
    SwitchCall(7.2, "bf16", 4),
    SwitchCall(9.0, "fp8", 5),
]


def test_switch_delays_count_the_steps_launched_after_the_call_in_the_old_set() -> None:
    delays = switch_delays(STEPS, CALLS)
    assert [d.precision for d in delays] == ["fp8", "bf16", "fp8", "bf16", "fp8"]
    assert delays[0] == SwitchDelay("fp8", 3, pytest.approx(0.5), 0)
    assert delays[1] == SwitchDelay("bf16", 5, pytest.approx(0.8), 1)
    assert delays[2] == SwitchDelay("fp8", None, None, None)  # superseded by switch 4
    assert delays[3] == SwitchDelay("bf16", 7, pytest.approx(0.3), 0)
    assert delays[4] == SwitchDelay("fp8", None, None, None)  # the load had ended
    assert switch_delays([], CALLS[:1]) == [SwitchDelay("fp8", None, None, None)]


def test_periods_split_the_steps_by_switch_count() -> None:
    periods = precision_periods(STEPS)
    assert [(p.precision, p.num_switches, p.num_steps) for p in periods] == [
        ("bf16", 0, 3),
        ("fp8", 1, 2),
        ("bf16", 2, 2),
        ("bf16", 4, 1),
    ]
    assert [p.num_output_tokens for p in periods] == [9, 16, 8, 4]
    # From the first launch, then from the end of the previous period's last step.
    assert [p.duration_s for p in periods] == pytest.approx([3.0, 2.0, 2.0, 1.0])
    assert [p.interior for p in periods] == [False, True, True, False]
    assert [p.tokens_per_s for p in periods] == pytest.approx([3.0, 8.0, 4.0, 4.0])
    assert precision_periods([]) == []


def test_per_precision_uses_the_interior_periods_when_there_are_some() -> None:
    figures = per_precision(precision_periods(STEPS))
    assert figures["fp8"] == {
        "tokens_per_s": pytest.approx(8.0),
        "num_periods": 1,
        "num_output_tokens": 16,
        "duration_s": pytest.approx(2.0),
    }
    assert figures["bf16"]["num_periods"] == 1 and figures["bf16"]["num_output_tokens"] == 8
    # One switch: no interior period, so each set's one period counts.
    two = per_precision(precision_periods(STEPS[:5]))
    assert two["bf16"]["tokens_per_s"] == pytest.approx(3.0)
    assert two["fp8"]["tokens_per_s"] == pytest.approx(8.0)


class _FakeEngine:
    """`generate` yields one final output of `num_tokens` tokens, or raises."""

    def __init__(self, num_tokens: int, reason: str = "length", error: bool = False) -> None:
        self.num_tokens, self.reason, self.error = num_tokens, reason, error

    async def generate(self, request_id, prompt, params):
        if self.error:
            raise RuntimeError("engine dead")
        completion = SimpleNamespace(token_ids=[1] * self.num_tokens, finish_reason=self.reason)
        yield SimpleNamespace(outputs=[completion], num_precision_switches=3)


def test_failed_and_truncated_requests_are_counted() -> None:
    result = LoadResult()
    cases = [_FakeEngine(5), _FakeEngine(4), _FakeEngine(5, "abort"), _FakeEngine(5, error=True)]
    for i, engine in enumerate(cases):
        asyncio.run(_one_request(engine, f"r{i}", [1, 2], 0.0, 5, result))
    assert result.num_output_tokens == [5, 4, 5]
    assert (result.num_truncated, result.num_failed) == (2, 1)
    assert result.errors == ["r3: RuntimeError('engine dead')"]
    assert result.max_precision_switches == 3


def test_the_benchmark_switches_under_load_on_a_tiny_checkpoint(
    tiny_model_factory, tmp_path, capsys, monkeypatch
) -> None:
    out_json = tmp_path / "ps.json"
    argv = ["bench", "precision-switch", "--model", str(tiny_model_factory("qwen3_moe"))]
    argv += ["--dtype", "float32", "--precision-switch", "fp8", "--num-prompts", "4"]
    argv += ["--input-len", "8", "--output-len", "24", "--num-switches", "4"]
    argv += ["--switch-every-steps", "3", "--max-num-seqs", "4", "--output-json", str(out_json)]
    monkeypatch.setattr("sys.argv", ["sits", *argv])
    assert main(argv) == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "sits.bench.precision_switch/1"
    assert doc["precisions"] == ["fp32", "fp8"]
    assert (doc["num_switches_requested"], doc["num_switches_made"]) == (4, 4)
    assert doc["requests"] == {
        "num_requests": 4,
        "num_failed": 0,
        "num_truncated": 0,  # each request: exactly 24 tokens, finish reason "length"
        "num_output_tokens": 4 * 24,
        "errors": [],
        "max_precision_switches": 4,
    }
    switches = doc["switches"]
    assert [s["precision"] for s in switches] == ["fp8", "fp32", "fp8", "fp32"]
    # The engine loop applies a call between steps: at most the step planned while the call
    # was on its way can run in the old set.
    assert all(s["delay_steps"] in (0, 1) and s["delay_ms"] > 0 for s in switches)
    periods = doc["periods"]
    assert [p["precision"] for p in periods] == ["fp32", "fp8", "fp32", "fp8", "fp32"]
    assert [p["num_switches"] for p in periods] == [0, 1, 2, 3, 4]
    # Each switch came once 3 steps had run in the set before it.
    assert all(p["num_steps"] >= 3 for p in periods[:-1])
    assert sum(p["num_output_tokens"] for p in periods) == 4 * 24
    assert [p["interior"] for p in periods] == [False, True, True, True, False]
    assert doc["per_precision"]["fp8"]["num_periods"] == 2
    assert doc["per_precision"]["fp32"]["num_periods"] == 1
    printed = capsys.readouterr().out
    assert printed.startswith("Command: ") and printed.count("Command: ") == 1
    assert "| precision | output tok/s | periods | output tokens | seconds |" in printed
    assert "| switch | to | delay ms | delay steps | tok/s before | tok/s after |" in printed
    assert "4/4 switches; delay median " in printed
    assert "requests failed 0, truncated 0 of 4" in printed
