"""The two engine modes agree (`AsyncMPLLM`, the loop in a child process, against `AsyncLLM`
with the loop in a thread): same outputs, stop strings and errors; and what only the process
mode has: a killed child fails requests at once, startup errors reach the constructor, errors
survive the pipe. The tests both modes share are in `test_async_llm.py`.

Each AsyncMPLLM spawns a child that imports torch (seconds), so the engines are module-scoped
and the tests that need their own child are few.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, InvalidParameterError, PromptTooLongError
from sits.core.outputs import RequestOutput
from sits.core.sampling_params import RequestOutputKind, SamplingParams
from sits.engine.async_llm import AsyncLLM
from sits.engine.async_mp import AsyncMPLLM
from sits.engine.messages import pack_error, unpack_error
from tests.waits import wait_until

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 2
DELTA = RequestOutputKind.DELTA


def _config(model_dir: Any, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "kv_cache_memory_bytes": 8 << 20,
    }
    kwargs.update(overrides)
    return EngineConfig(model=str(model_dir), **kwargs)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="module")
def run():
    """`run(coro)` on one event loop for the module (as a server's loop: AsyncLLM's engine
    thread must not deliver late outputs to a loop that `asyncio.run` closed)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(scope="module")
def thread_engine(model_dir, run):
    eng = AsyncLLM(_config(model_dir))
    yield eng
    run(eng.shutdown())


@pytest.fixture(scope="module")
def mp_engine(model_dir, run):
    eng = AsyncMPLLM(_config(model_dir))
    yield eng
    run(eng.shutdown())


async def _collect(engine: Any, request_id: str, ids: list[int], params: SamplingParams):
    return [out async for out in engine.generate(request_id, ids, params)]


def _joined(outs: list[RequestOutput]) -> list[tuple[list[int], str, Any]]:
    """Per sample: all delta tokens, all delta text, finish reason."""
    num_samples = max(c.index for o in outs for c in o.outputs) + 1
    joined = []
    for index in range(num_samples):
        parts = [c for o in outs for c in o.outputs if c.index == index]
        tokens = [t for c in parts for t in c.token_ids]
        joined.append((tokens, "".join(c.text for c in parts), parts[-1].finish_reason))
    return joined


def _requests(engine: Any) -> list[tuple[str, list[int], SamplingParams]]:
    encode = engine.tokenizer.encode
    return [
        (
            "greedy-a",
            encode("def fibonacci(n):"),
            SamplingParams(temperature=0, max_tokens=24, output_kind=RequestOutputKind.FINAL_ONLY),
        ),
        (
            "greedy-b",
            encode("The capital of France is"),
            SamplingParams(temperature=0, max_tokens=17, output_kind=DELTA),
        ),
        (
            "sampled-n2",
            encode("Once upon a time"),
            SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, output_kind=DELTA),
        ),
        (
            "ignore-eos",
            list(range(5, 40)),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=DELTA),
        ),
    ]


async def _run_all(engine: Any) -> dict[str, list[RequestOutput]]:
    requests = _requests(engine)
    results = await asyncio.gather(*(_collect(engine, *r) for r in requests))
    return {r[0]: outs for r, outs in zip(requests, results, strict=True)}


def test_concurrent_outputs_equal_async_llm(run, thread_engine, mp_engine) -> None:
    expected = run(_run_all(thread_engine))
    got = run(_run_all(mp_engine))
    assert set(got) == set(expected)
    for request_id, outs in got.items():
        assert outs[-1].finished and sum(o.finished for o in outs) == 1
        assert _joined(outs) == _joined(expected[request_id]), request_id
    final = got["greedy-a"]  # FINAL_ONLY: one output with every token
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == 24
    assert len(_joined(got["sampled-n2"])) == 2
    assert _joined(got["sampled-n2"])[0][0] != _joined(got["sampled-n2"])[1][0]
    assert len(got["greedy-b"]) > 1  # streamed as deltas
    assert [len(_joined(o)[0][0]) for o in (got["greedy-b"], got["ignore-eos"])] == [17, 30]
    assert mp_engine.stats().num_running == 0 and mp_engine.is_healthy()


def test_stop_string_finishes_in_the_child(run, thread_engine, mp_engine) -> None:
    """A stop string is found by the parent's detokenizer and finished in the child."""
    ids = mp_engine.tokenizer.encode("def fibonacci(n):")
    free = SamplingParams(temperature=0, max_tokens=24)
    text = run(_collect(thread_engine, "free", ids, free))[-1].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0, max_tokens=24, stop=[stop])
    want = run(_collect(thread_engine, "stop-t", ids, params))[-1].outputs[0]
    got = run(_collect(mp_engine, "stop-p", ids, params))[-1].outputs[0]
    assert len(text) >= 4 and (want.finish_reason, want.stop_reason) == ("stop", stop)
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        want.text,
        want.token_ids,
        "stop",
        stop,
    )
    assert len(got.token_ids) < 24
    assert wait_until(lambda: mp_engine.stats().num_running == 0)


def _error_of(fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for comparison
        return exc
    raise AssertionError("no error raised")


def test_request_errors_equal_async_llm(run, thread_engine, mp_engine) -> None:
    too_long = SamplingParams(max_tokens=100)
    prompt = list(range(3, 200))
    want = _error_of(lambda: run(_collect(thread_engine, "long", prompt, too_long)))
    got = _error_of(lambda: run(_collect(mp_engine, "long", prompt, too_long)))
    assert type(got) is type(want) is PromptTooLongError
    assert (str(got), got.param) == (str(want), want.param)
    bad = [3, 10**7]
    want = _error_of(lambda: run(_collect(thread_engine, "vocab", bad, too_long)))
    got = _error_of(lambda: run(_collect(mp_engine, "vocab", bad, too_long)))
    assert type(got) is type(want) is InvalidParameterError
    assert (str(got), got.param) == (str(want), "prompt")
    assert mp_engine.is_healthy() and not mp_engine._processor.has_request("long")
    want = _error_of(lambda: run(thread_engine.freeze_expert(9, 0)))
    got = _error_of(lambda: run(mp_engine.freeze_expert(9, 0)))
    assert type(got) is type(want) is InvalidParameterError
    assert (str(got), got.param) == (str(want), want.param)


def test_packed_errors_keep_class_message_and_param() -> None:
    exc = unpack_error(pack_error(InvalidParameterError("temperature", "must be >= 0")))
    assert type(exc) is InvalidParameterError
    assert (str(exc), exc.param) == ("must be >= 0", "temperature")
    exc = unpack_error(pack_error(PromptTooLongError("too long", param="messages")))
    assert (type(exc), str(exc), exc.param) == (PromptTooLongError, "too long", "messages")
    local = type("LocalError", (Exception,), {})
    fallback = unpack_error(pack_error(local("x")))
    assert type(fallback) is RuntimeError and "LocalError('x')" in str(fallback)


def test_killed_child_fails_in_flight_requests(model_dir) -> None:
    eng = AsyncMPLLM(_config(model_dir))
    long = SamplingParams(max_tokens=MAX_MODEL_LEN - 40, ignore_eos=True, output_kind=DELTA)

    async def scenario() -> None:
        gen = eng.generate("victim", list(range(3, 30)), long)
        first = await gen.__anext__()
        assert not first.finished
        pending = asyncio.ensure_future(eng.prefill_chunks())
        os.kill(eng.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await pending
        assert not eng.is_healthy() and eng.errored
        with pytest.raises(EngineDeadError, match="exit code -9"):
            await _collect(eng, "late", [3, 4, 5], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await eng.expert_stats()
        await eng.shutdown()

    asyncio.run(scenario())
    assert eng.transport.exitcode == -signal.SIGKILL


def test_startup_error_is_raised_by_the_constructor(model_dir) -> None:
    config = _config(model_dir, max_model_len=10**7)
    want = _error_of(lambda: AsyncLLM(config))
    got = _error_of(lambda: AsyncMPLLM(config))
    assert isinstance(want, InvalidParameterError)
    assert type(got) is type(want) and str(got) == str(want) and got.param == want.param
