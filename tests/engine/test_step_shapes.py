"""`SITS_STEP_SHAPES_FILE`: an engine writes each step's shape as one JSON line (for offline
replays, `bench/profile_step.py --replay`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sits import LLM, SamplingParams
from sits.engine.step_shapes import STEP_SHAPES_ENV, read_step_shapes


def test_every_step_is_written_with_its_requests_start_and_tokens(
    tiny_model_factory, tmp_path: Path, monkeypatch
) -> None:
    path = tmp_path / "shapes.jsonl"
    monkeypatch.setenv(STEP_SHAPES_ENV, str(path))
    llm = LLM(model=str(tiny_model_factory("qwen3")), dtype="float32", max_num_batched_tokens=8,
              skip_tokenizer_init=True)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 6}, {"prompt_token_ids": [7] * 4}], params)
    steps = read_step_shapes(str(path))
    # A budget of 8 tokens: the first prompt whole and 2 tokens of the second, then the
    # second's last 2 beside the first's decode, then decodes until each has 3 tokens.
    assert [s["reqs"] for s in steps] == [
        [[0, 6], [0, 2]],
        [[6, 1], [2, 2]],
        [[7, 1], [4, 1]],
        [[5, 1]],
    ]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["runner_ms"] >= 0 for s in steps)


def test_without_the_variable_nothing_is_recorded(tiny_model_factory, monkeypatch) -> None:
    monkeypatch.delenv(STEP_SHAPES_ENV, raising=False)
    llm = LLM(model=str(tiny_model_factory("qwen3")), dtype="float32", skip_tokenizer_init=True)
    assert llm.engine_core.step_shapes is None


def test_a_line_that_is_not_a_step_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 1, "runner_ms": 1.0, "reqs": [[0, 4]]}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match="bad.jsonl:3: not a step shape line"):
        read_step_shapes(str(path))
