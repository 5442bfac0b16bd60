"""AsyncLLM in both engine modes (loop in a thread, loop in a child process): streaming deltas,
abort frees blocks, stats, borrowing tiers, expert calls, timelines, errors before the first
output, a dead loop, shutdown.

A process-mode engine spawns a child that imports torch (seconds), so the engines are
module-scoped (one per mode) and the tests that need their own engine are few.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, InvalidParameterError, PromptTooLongError
from sits.core.sampling_params import RequestOutputKind, SamplingParams
from sits.engine.async_llm import AsyncLLM
from sits.engine.llm import LLM
from sits.engine.messages import AddRequest
from tests.waits import async_wait_until, wait_until

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 2
DELTA = RequestOutputKind.DELTA
MODES = ("thread", "process")


def async_config(model_dir: Any, **overrides: Any) -> EngineConfig:
    """The engines' configuration (small KV cache, two sequences at a time)."""
    kwargs: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "kv_cache_memory_bytes": 8 << 20,
    }
    kwargs.update(overrides)
    return EngineConfig(model=str(model_dir), **kwargs)


def make_engine(mode: str, config: EngineConfig) -> AsyncLLM:
    """An `AsyncLLM` of `config` in `mode` ("thread" or "process")."""
    return AsyncLLM(config, engine_process=mode == "process")


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def run():
    """`run(coro)` on one event loop for the module (as a server's loop: the engine must not
    deliver late outputs to a loop that `asyncio.run` closed)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(scope="module", params=MODES)
def engine(request, model_dir, run):
    eng = make_engine(request.param, async_config(model_dir))
    yield eng
    run(eng.shutdown())


async def _collect(engine: AsyncLLM, request_id: str, ids: list[int], params: SamplingParams):
    return [out async for out in engine.generate(request_id, ids, params)]


def test_pid_names_the_engine_process_only(engine: AsyncLLM) -> None:
    assert (engine.pid is None) == (engine.engine_core is not None)


def test_stream_deltas_join_to_offline_result(engine: AsyncLLM, run, model_dir) -> None:
    ids = engine.tokenizer.encode("def fibonacci(n):")
    delta = SamplingParams(temperature=0, max_tokens=20, output_kind=DELTA)
    outs = run(_collect(engine, "s1", ids, delta))
    text = "".join(c.text for o in outs for c in o.outputs)
    tokens = [t for o in outs for c in o.outputs for t in c.token_ids]
    offline = LLM(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=20))
    assert outs[-1].finished
    assert tokens == ref[0].outputs[0].token_ids
    assert text == ref[0].outputs[0].text
    metrics = outs[-1].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time


def test_abort_frees_blocks(engine: AsyncLLM, run) -> None:
    total = engine.stats().num_total_blocks

    async def scenario() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA)
        gen = engine.generate("cut", list(range(3, 40)), params)
        await gen.__anext__()
        await gen.aclose()
        await async_wait_until(lambda: engine.stats().num_running == 0)

    run(scenario())
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == total


def test_abort_frees_the_request(engine: AsyncLLM, run) -> None:
    total = engine.stats().num_total_blocks
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA)

    async def scenario() -> None:
        gen = engine.generate("cut-2", list(range(3, 40)), long)
        await gen.__anext__()
        assert await async_wait_until(lambda: engine.stats().num_running == 1)
        assert engine.stats().num_free_blocks < total
        await gen.aclose()
        other = engine.generate("aborted", list(range(3, 40)), long)
        await other.__anext__()
        await engine.abort("aborted")
        await other.aclose()

    run(scenario())

    def load() -> tuple[int, int, int]:
        stats = engine.stats()
        return stats.num_running, stats.num_waiting, stats.num_free_blocks

    assert wait_until(lambda: load() == (0, 0, total)), load()


def test_too_long_raises_before_output(engine: AsyncLLM, run) -> None:
    params = SamplingParams(max_tokens=100)
    with pytest.raises(PromptTooLongError, match="256"):
        run(_collect(engine, "long", list(range(3, 200)), params))
    assert engine.is_healthy() and not engine._processor.has_request("long")


def test_outputs_for_a_closed_loop_never_kill_the_engine(engine: AsyncLLM, run) -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    engine._loop = closed  # what a finished asyncio.run leaves behind
    engine._post(engine._deliver, [])  # dropped, no RuntimeError on the engine's side

    async def abandon() -> None:  # leaves its stream unfinished when the loop ends
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate("abandoned", list(range(3, 20)), params)
        asyncio.get_running_loop().create_task(stream.__anext__())
        await asyncio.sleep(0.05)

    asyncio.run(abandon())
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = run(_collect(engine, "after-closed-loop", list(range(3, 12)), params))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert engine.is_healthy()
    assert wait_until(lambda: engine.stats().num_running + engine.stats().num_waiting == 0)


def test_stats_show_running_and_waiting(engine: AsyncLLM, run) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA)

    async def scenario() -> tuple[int, int]:
        gens = [engine.generate(f"load-{i}", list(range(3, 20)), long) for i in range(3)]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)

        def counts() -> tuple[int, int]:
            stats = engine.stats()
            return stats.num_running, stats.num_waiting

        await async_wait_until(lambda: counts() == (2, 1))
        seen = counts()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await gen.aclose()
        return seen

    assert run(scenario()) == (MAX_NUM_SEQS, 1)
    assert wait_until(lambda: engine.stats().num_running + engine.stats().num_waiting == 0)


def test_set_borrowing_tiers_reaches_the_loop(engine: AsyncLLM) -> None:
    engine.set_borrowing_tiers(["guaranteed"])
    assert wait_until(lambda: engine.stats().borrowing_tiers == ("guaranteed",))
    with pytest.raises(ValueError):
        engine.set_borrowing_tiers(["gold"])
    engine.set_borrowing_tiers(["best_effort", "guaranteed", "burstable"])
    everyone = ("guaranteed", "burstable", "best_effort")
    assert wait_until(lambda: engine.stats().borrowing_tiers == everyone)


def test_expert_calls_and_prefill_chunks(engine: AsyncLLM, run) -> None:
    async def scenario() -> None:
        stats = await engine.expert_stats()
        assert stats is not None and [layer.layer_id for layer in stats.layers] == [0, 1]
        frozen = await engine.freeze_expert(1, 3)
        assert frozen.layers[1].frozen[3] and not any(frozen.layers[0].frozen)
        thawed = await engine.unfreeze_expert(1, 3)
        assert not any(thawed.layers[1].frozen)
        assert not any(engine.stats().experts.layers[1].frozen)
        with pytest.raises(InvalidParameterError) as info:
            await engine.freeze_expert(9, 0)
        assert info.value.param == "layer"
        params = SamplingParams(temperature=0, max_tokens=2)
        await _collect(engine, "chunked", list(range(100, 157)), params)
        chunks = [c for c in await engine.prefill_chunks() if c.request_id == "chunked"]
        assert sum(c.num_tokens for c in chunks) == 57

    run(scenario())


def test_record_timeline_reaches_the_loop(engine: AsyncLLM, run) -> None:
    params = SamplingParams(temperature=0, max_tokens=3)
    engine.record_timeline(True)
    try:
        outs = run(_collect(engine, "timed", list(range(200, 227)), params))
    finally:
        engine.record_timeline(False)
    chunks = outs[-1].metrics.prefill_chunks
    assert chunks is not None and sum(n for _, n in chunks) == 27
    outs = run(_collect(engine, "untimed", list(range(300, 327)), params))
    assert outs[-1].metrics.prefill_chunks is None


@pytest.mark.parametrize("mode", MODES)
def test_loop_failure_fails_requests_with_its_error(mode: str, model_dir) -> None:
    eng = make_engine(mode, async_config(model_dir))
    long = SamplingParams(max_tokens=100, ignore_eos=True, output_kind=DELTA)

    async def scenario() -> None:
        gen = eng.generate("in-flight", list(range(3, 30)), long)
        await gen.__anext__()
        eng._send(AddRequest("bogus", (object(),)))  # not a Request: the loop raises
        with pytest.raises(EngineDeadError, match="AttributeError"):
            async for _ in gen:
                pass
        assert isinstance(eng.dead_error, AttributeError) and not eng.is_healthy()
        with pytest.raises(EngineDeadError):
            await _collect(eng, "late", [5, 6, 7], SamplingParams(max_tokens=4))
        await eng.shutdown()

    asyncio.run(scenario())
    if mode == "process":
        assert eng.transport.exitcode == 1


def test_dead_loop_fails_requests_and_health(model_dir) -> None:
    eng = make_engine("thread", async_config(model_dir))

    def broken_step(*args):
        raise RuntimeError("injected fault")

    eng.engine_core.step = broken_step
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(eng, "x", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert not eng.is_healthy()
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(eng, "y", [5, 6, 7], SamplingParams(max_tokens=4)))


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_stops_the_loop(mode: str, model_dir) -> None:
    eng = make_engine(mode, async_config(model_dir))
    assert eng.is_healthy()

    async def scenario() -> None:
        out = await _collect(eng, "one", [3, 4, 5], SamplingParams(temperature=0, max_tokens=2))
        assert len(out[-1].outputs[0].token_ids) == 2
        await eng.shutdown()

    asyncio.run(scenario())
    assert not eng.transport.alive() and not eng.is_healthy() and not eng.errored
    if mode == "process":
        assert eng.transport.exitcode == 0
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(eng, "after", [3, 4], SamplingParams(max_tokens=2)))
