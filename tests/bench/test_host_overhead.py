"""sits.bench.host_overhead: its table's columns add up, it counts the pure decode steps, and the
engine is left as it was (timers and the null forward removed)."""

from __future__ import annotations

from sits.bench import host_overhead as ho
from sits.engine.output_processor import OutputProcessor


def test_columns_add_up_and_engine_is_restored() -> None:
    llm = ho.build_llm(max_num_seqs=4, seed=0)
    core = llm.engine_core
    objects = [core, core.scheduler, core.runner, core.runner.buffers, core.runner.model]
    attributes = [set(vars(obj)) for obj in objects]  # instance attributes before the run
    sampler = core.runner.sampler
    row = ho.run_case(llm, batch_size=3, sampling="top_p", null_forward=True, output_len=5, seed=0)
    # 3 prompts of 16 tokens fit one prefill step (token 1), then 4 decode steps.
    assert row["steps"] == 4
    assert row["forward"] < row["step"] <= row["loop"]
    assert row["schedule"] > 0 and row["prep"] > 0 and row["sample"] > 0 and row["output"] > 0
    # Per step the parts sum to the loop exactly (up to float rounding, in us).
    assert row["unaccounted"] < 1e-3
    assert [set(vars(obj)) for obj in objects] == attributes
    assert "step" not in vars(core) and core.runner.sampler is sampler
    assert OutputProcessor.process.__qualname__ == "OutputProcessor.process"
    # The real forward is back: greedy tokens equal a fresh engine's.
    from sits import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    again = ho.build_llm(max_num_seqs=4, seed=0).generate(prompt, params)
    assert llm.generate(prompt, params)[0].outputs[0].token_ids == again[0].outputs[0].token_ids
