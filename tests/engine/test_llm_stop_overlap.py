"""`LLM.generate` processes a step's outputs while the next step runs (`LLM._run`): a stop
string found there ends its request one step late, and the extra token must not show."""

from __future__ import annotations

from pathlib import Path

import pytest

from sits import LLM, SamplingParams
from sits.engine.output_processor import OutputProcessor

DEMO_DIR = Path(__file__).resolve().parents[2] / "src" / "sits" / "demo_model"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef ", "class Stack:\n"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(DEMO_DIR), dtype="float32", max_model_len=512)


def test_stop_string_ends_at_its_token_with_others_running(llm: LLM) -> None:
    tok = llm.tokenizer
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]
    full = llm.generate(prompts, greedy)
    ids = full[1].outputs[0].token_ids
    text = full[1].outputs[0].text
    # A stop string made of the text of tokens 8-9: it completes at token 9 or 10 at the latest.
    stop = tok.decode(ids[8:10]).strip() or tok.decode(ids[8:12])
    cut = text.index(stop)
    first_k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    assert first_k < len(ids)  # the request stops early; the others keep running

    stopped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    outs = llm.generate(prompts, [greedy, stopped, greedy])
    out = outs[1].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == ids[:first_k]
    assert out.text == text[:cut]
    # The requests beside it are unchanged, and nothing is left in the engine.
    assert outs[0].outputs[0].token_ids == full[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == full[2].outputs[0].token_ids
    assert not llm.engine_core.has_unfinished_requests()
    assert llm.engine_core.scheduler.num_running == 0


def test_outputs_processed_in_the_steps_shadow(llm: LLM, monkeypatch) -> None:
    """Each step's outputs are processed inside the next step's `while_gpu_runs` (the
    runner's "shadow" phase), the last step's after the loop."""
    runner = llm.engine_core.runner
    done_at_shadow: list[int] = []  # processing calls made when each step's shadow begins
    num_processed = [0]
    original_run = runner.run
    original_process = OutputProcessor.process

    def run(plan, while_gpu_runs=None):
        def shadow() -> None:
            done_at_shadow.append(num_processed[0])
            if while_gpu_runs is not None:
                while_gpu_runs()

        return original_run(plan, shadow)

    def process(self, outputs, now_s=None):
        num_processed[0] += 1
        return original_process(self, outputs, now_s)

    monkeypatch.setattr(runner, "run", run)
    monkeypatch.setattr(OutputProcessor, "process", process)
    prompt = {"prompt_token_ids": llm.tokenizer.encode(PROMPTS[0])}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    # 6 steps (a prefill, 5 decodes): step k's shadow processes step k-1, so when it begins
    # k-2 steps are processed; processed after each step it would be k-1.
    assert done_at_shadow == [0, 0, 1, 2, 3, 4]
    assert num_processed[0] == 6
