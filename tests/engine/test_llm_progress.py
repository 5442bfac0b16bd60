"""`LLM.generate` / `LLM.chat`: vLLM's "Processed prompts" bar on stderr (`use_tqdm`)."""

from __future__ import annotations

import io
import re

import pytest
from tqdm import tqdm

from sits import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
PROMPTS = [
    {"prompt_token_ids": [5, 17, 99]},
    {"prompt_token_ids": [4, 2]},
    {"prompt_token_ids": [1]},
]


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(str(tiny_model_factory("llama")), dtype="float32")


def test_generate_shows_a_bar_over_the_prompts_with_speeds(llm: LLM, capsys) -> None:
    capsys.readouterr()  # what building the engine printed
    outputs = llm.generate(PROMPTS, PARAMS)
    err = capsys.readouterr().err
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 5, 5]
    final = err.split("\r")[-1]  # the bar's last state, written when it closes
    assert final.startswith("Processed prompts: 100%")
    assert " 3/3 " in final
    speeds = re.search(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", final)
    assert speeds is not None
    assert float(speeds.group(1)) > 0 and float(speeds.group(2)) > 0
    # 6 prompt tokens and 15 output tokens over the same elapsed time
    assert float(speeds.group(2)) / float(speeds.group(1)) == pytest.approx(15 / 6, rel=0.01)


def test_use_tqdm_false_prints_nothing(llm: LLM, capsys) -> None:
    capsys.readouterr()
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(outputs) == 3
    assert capsys.readouterr().err == ""


def test_use_tqdm_callable_makes_the_bar(llm: LLM, capsys) -> None:
    made: list[tuple[tqdm, io.StringIO]] = []

    def make_bar(**kwargs: object) -> tqdm:
        out = io.StringIO()
        made.append((tqdm(**kwargs, file=out), out))
        return made[-1][0]

    capsys.readouterr()
    llm.generate(PROMPTS, PARAMS, use_tqdm=make_bar)
    assert capsys.readouterr().err == ""  # the callable's bar writes elsewhere
    assert len(made) == 1
    bar, out = made[0]
    assert (bar.total, bar.n) == (3, 3)
    assert out.getvalue().split("\r")[-1].startswith("Processed prompts: 100%")
