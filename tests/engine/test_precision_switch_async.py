"""The precision switch through the asyncio front ends: `AsyncLLM` (engine thread) and
`AsyncMPLLM` (engine process) switch between steps while a request streams, report the state
and the per-request fields, and refuse bad names with the same error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sits import SamplingParams
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import RequestOutputKind
from sits.engine.async_llm import AsyncLLM
from sits.engine.async_mp import AsyncMPLLM


@pytest.fixture(scope="module")
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request, tiny_model_factory, run):
    config = EngineConfig(
        model=str(tiny_model_factory("qwen3")),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=8 << 20,
        precision_switch="fp8",
    )
    eng = AsyncLLM(config) if request.param == "thread" else AsyncMPLLM(config)
    yield eng
    run(eng.shutdown())


async def _stream_with_switches(engine: Any) -> list[Any]:
    """One streamed request; switch to fp8 after its 4th output, back after its 12th."""
    params = SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    outs = []
    async for out in engine.generate("r", list(range(5, 20)), params):
        outs.append(out)
        if len(outs) == 4:
            state = await engine.set_precision("fp8")
            assert state.current == "fp8" and engine.precision_state().current == "fp8"
        elif len(outs) == 12:
            assert (await engine.set_precision("fp32")).current == "fp32"
    return outs


def test_a_streamed_request_switches_and_finishes(engine, run) -> None:
    before = engine.precision_state().num_switches
    outs = run(_stream_with_switches(engine))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 40
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    precisions = [o.precision for o in outs]
    assert precisions[0] == "fp32" and "fp8" in precisions and precisions[-1] == "fp32"
    assert (outs[0].num_precision_switches, outs[-1].num_precision_switches) == (0, 2)
    state = engine.precision_state()
    assert state.num_switches == before + 2 and state.available == ("fp32", "fp8")
    assert state.last_switch_step is not None and state.last_switch_delay_s is not None
    assert state.last_switch_unix_s is not None


def test_an_unknown_precision_is_refused(engine, run) -> None:
    with pytest.raises(InvalidParameterError) as info:
        run(engine.set_precision("int4"))
    assert info.value.param == "precision" and "fp32, fp8" in str(info.value)
    assert engine.precision_state().current == "fp32"
