"""`SITS_PROFILE_STEPS=START:COUNT`: an engine profiles that window of its steps and writes
torch.profiler's table to `SITS_PROFILE_FILE`."""

from __future__ import annotations

from pathlib import Path

import pytest

from sits import LLM, SamplingParams
from sits.core.errors import InvalidParameterError
from sits.engine.step_profile import PROFILE_FILE_ENV, PROFILE_STEPS_ENV, profiler_from_env


def test_the_window_of_steps_is_profiled_and_written_once(
    tiny_model_factory, tmp_path: Path, monkeypatch
) -> None:
    out = tmp_path / "profile.txt"
    monkeypatch.setenv(PROFILE_STEPS_ENV, "2:2")
    monkeypatch.setenv(PROFILE_FILE_ENV, str(out))
    llm = LLM(model=str(tiny_model_factory("qwen3")), dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 6}], params)  # 5 steps: prefill + 4 decodes
    profiler = llm.engine_core.step_profiler
    assert profiler is not None and profiler.done
    text = out.read_text()
    assert text.startswith("# steps 2-3 (2 steps), torch.profiler\n")
    assert "aten::" in text and "Self CPU" in text  # the table, with the model's ops


def test_unset_means_no_profiler_and_a_bad_value_is_named() -> None:
    assert profiler_from_env({}) is None and profiler_from_env({PROFILE_STEPS_ENV: ""}) is None
    profiler = profiler_from_env({PROFILE_STEPS_ENV: "10:3", PROFILE_FILE_ENV: "/tmp/p.txt"})
    assert (profiler.start, profiler.count, profiler.path) == (10, 3, "/tmp/p.txt")
    for bad in ("10", "a:b", "1:2:3"):
        with pytest.raises(InvalidParameterError, match="must be START:COUNT") as err:
            profiler_from_env({PROFILE_STEPS_ENV: bad})
        assert err.value.param == PROFILE_STEPS_ENV
    with pytest.raises(InvalidParameterError, match="must both be >= 1, got 0:5"):
        profiler_from_env({PROFILE_STEPS_ENV: "0:5"})
