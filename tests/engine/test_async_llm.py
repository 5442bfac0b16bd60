"""AsyncLLM: streaming deltas, abort frees blocks, errors before the first output, dead loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, PromptTooLongError
from sits.core.sampling_params import RequestOutputKind, SamplingParams
from sits.engine.async_llm import AsyncLLM
from sits.engine.llm import LLM


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3_moe")
    eng = AsyncLLM(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256))
    yield eng
    asyncio.run(eng.shutdown())


async def _collect(engine: AsyncLLM, request_id: str, ids: list[int], params: SamplingParams):
    return [out async for out in engine.generate(request_id, ids, params)]


def test_stream_deltas_join_to_offline_result(engine: AsyncLLM, tiny_model_factory) -> None:
    ids = engine.tokenizer.encode("def fibonacci(n):")
    delta = SamplingParams(temperature=0, max_tokens=20, output_kind=RequestOutputKind.DELTA)
    outs = asyncio.run(_collect(engine, "s1", ids, delta))
    text = "".join(c.text for o in outs for c in o.outputs)
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    offline = LLM(model=str(tiny_model_factory("qwen3_moe")), dtype="float32", max_model_len=256)
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=20))
    assert outs[-1].finished
    assert tokens == ref[0].outputs[0].token_ids
    assert text == ref[0].outputs[0].text
    metrics = outs[-1].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time


def test_abort_frees_blocks(engine: AsyncLLM) -> None:
    total = engine.stats().num_total_blocks

    async def run() -> None:
        params = SamplingParams(
            max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        gen = engine.generate("cut", list(range(3, 40)), params)
        await gen.__anext__()
        await gen.aclose()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and engine.stats().num_running:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == total


def test_too_long_raises_before_output(engine: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=100)
    with pytest.raises(PromptTooLongError, match="256"):
        asyncio.run(_collect(engine, "long", list(range(3, 200)), params))
    assert engine.is_healthy()


def test_outputs_for_a_closed_loop_never_kill_the_engine(engine: AsyncLLM) -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    engine._loop = closed  # what a finished asyncio.run leaves behind
    engine._post(engine._deliver, [])  # dropped, no RuntimeError on the engine thread

    async def abandon() -> None:  # leaves its stream unfinished when the loop ends
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate("abandoned", list(range(3, 20)), params)
        asyncio.get_running_loop().create_task(stream.__anext__())
        await asyncio.sleep(0.05)

    asyncio.run(abandon())
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = asyncio.run(_collect(engine, "after-closed-loop", list(range(3, 12)), params))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert engine.is_healthy()


def test_dead_loop_fails_requests_and_health(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    eng = AsyncLLM(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256))

    def broken_step(*args):
        raise RuntimeError("injected fault")

    eng.engine_core.step = broken_step
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(eng, "x", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert not eng.is_healthy()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(eng, "y", [5, 6, 7], SamplingParams(max_tokens=4)))
