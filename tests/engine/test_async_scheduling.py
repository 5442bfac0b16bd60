"""Async scheduling (`EngineConfig.async_scheduling`, `sits.engine.async_step`) gives the same
outputs as the synchronous engine: greedy and seeded sampling, stop tokens, preemption with
recompute, requests with logprobs or penalties beside plain ones, aborts while a step is in
flight; and it really plans a step while the one before it is in flight."""

from __future__ import annotations

import json

import pytest

from sits import LLM, SamplingParams
from sits.core.request import FinishReason
from sits.engine.output_processor import make_engine_requests
from tests.engine.hf_reference import random_prompts

NUM_PROMPTS = 10


@pytest.fixture(scope="module")
def moe_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


def _llm(moe_dir, async_scheduling: bool, **kwargs) -> LLM:
    return LLM(
        model=str(moe_dir),
        dtype="float32",
        max_model_len=256,
        async_scheduling=async_scheduling,
        skip_tokenizer_init=True,
        **kwargs,
    )


def _prompts(moe_dir) -> list[dict]:
    vocab = json.loads((moe_dir / "config.json").read_text())["vocab_size"]
    lengths = [5 + 7 * i for i in range(NUM_PROMPTS)]
    return [{"prompt_token_ids": p} for p in random_prompts(lengths, vocab, seed=11)]


def _summary(outs) -> list[tuple]:
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, c.logprobs) for o in outs for c in o.outputs
    ]


@pytest.fixture(scope="module")
def pair(moe_dir) -> tuple[LLM, LLM]:
    return _llm(moe_dir, False), _llm(moe_dir, True)


def _both(pair, prompts, params) -> tuple[list, list]:
    sync_llm, async_llm = pair
    return _summary(sync_llm.generate(prompts, params)), _summary(
        async_llm.generate(prompts, params)
    )


def test_greedy_with_stop_tokens_equals_sync(pair, moe_dir) -> None:
    prompts = _prompts(moe_dir)
    free = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) for i in range(10)]
    ref = pair[0].generate(prompts, free)
    # Each even request stops on the token it generated 3rd-8th, so requests end at
    # different steps, on a token the host only learns one step later.
    params = []
    for i, out in enumerate(ref):
        stop = [out.outputs[0].token_ids[3 + i % 6]] if i % 2 == 0 else []
        params.append(
            SamplingParams(temperature=0, max_tokens=12 + i, stop_token_ids=stop, ignore_eos=True)
        )
    sync_out, async_out = _both(pair, prompts, params)
    assert async_out == sync_out
    reasons = [entry[1] for entry in async_out]
    assert reasons.count("stop") == 5 and reasons.count("length") == 5
    assert not pair[1].engine_core.has_unfinished_requests()


def test_seeded_sampling_equals_sync(pair, moe_dir) -> None:
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=9 + i % 4)
        for i in range(NUM_PROMPTS)
    ]
    sync_out, async_out = _both(pair, _prompts(moe_dir), params)
    assert async_out == sync_out


def test_logprobs_and_penalties_beside_plain_requests(pair, moe_dir) -> None:
    """Requests needing host tokens make their steps synchronous; outputs are unchanged."""
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in range(6)]
    params[1] = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    params[3] = SamplingParams(
        temperature=0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5
    )
    sync_out, async_out = _both(pair, _prompts(moe_dir)[:6], params)
    assert async_out == sync_out
    assert async_out[1][3] is not None and len(async_out[1][3]) == 8


def test_preemption_with_recompute_equals_sync(moe_dir) -> None:
    probe = _llm(moe_dir, False)
    bytes_per_block = probe.engine_core.runner.kv_bytes_per_block
    del probe
    small = {"kv_cache_memory_bytes": 14 * bytes_per_block, "block_size": 16}
    prompts = _prompts(moe_dir)[:6]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for mode in (False, True):
        llm = _llm(moe_dir, mode, **small)
        outs[mode] = _summary(llm.generate(prompts, params))
        assert llm.engine_core.scheduler.num_preemptions > 0  # the cache is too small for all
    assert outs[True] == outs[False]


def test_abort_while_a_step_is_in_flight(pair, moe_dir) -> None:
    """An abort between steps (a step of the request is in flight) ends it; the others are
    as without it."""
    prompts = [p["prompt_token_ids"] for p in _prompts(moe_dir)[:4]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = {}
    for llm in pair:
        core = llm.engine_core
        for i, prompt in enumerate(prompts):
            for req in make_engine_requests(
                f"r{i}", prompt, params, eos_token_ids=(), max_model_len=256,
                enable_prefix_caching=True,
            ):  # fmt: skip
                core.add_request(req)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        finished: dict[str, FinishReason | None] = {}
        steps = 0
        while core.has_unfinished_requests():
            for out in core.step():
                got[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    finished[out.request_id] = out.finish_reason
            steps += 1
            if steps == 4:
                for out in core.finish_requests(["r2"], FinishReason.ABORT):
                    finished[out.request_id] = out.finish_reason
        tokens[llm.config.async_scheduling] = (got, finished)
    (sync_got, sync_fin), (async_got, async_fin) = tokens[False], tokens[True]
    for rid in ("r0", "r1", "r3"):
        assert async_got[rid] == sync_got[rid] and len(async_got[rid]) == 10
    assert async_got["r2"] == sync_got["r2"][: len(async_got["r2"])]
    assert async_fin == sync_fin and async_fin["r2"] is FinishReason.ABORT
    assert pair[1].engine_core.scheduler.num_running == 0


def test_next_step_is_launched_before_the_last_is_collected(moe_dir, monkeypatch) -> None:
    """Every decode step after the first is launched while the one before it is in flight:
    launch N+1 comes before collect N."""
    llm = _llm(moe_dir, True)
    runner = llm.engine_core.runner
    events: list[str] = []
    launch, collect = runner.launch, runner.collect

    def traced_launch(plan, previous):
        events.append("launch")
        return launch(plan, previous)

    def traced_collect(launched):
        events.append("collect")
        return collect(launched)

    monkeypatch.setattr(runner, "launch", traced_launch)
    monkeypatch.setattr(runner, "collect", traced_collect)
    prompt = _prompts(moe_dir)[0]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    # 5 steps (prefill + 4 decodes): the last step's plan finds nothing left to launch.
    assert events == ["launch", "launch", "collect"] * 1 + ["launch", "collect"] * 3 + ["collect"]
