"""`GrammarGate` in `EngineCore`: a constrained request waits out of the scheduler while its
grammar compiles, other requests run meanwhile, and held requests abort or fail cleanly."""

from __future__ import annotations

import re
from concurrent.futures import Future

import pytest

from sits import LLM, SamplingParams
from sits.core.errors import InvalidParameterError
from sits.core.request import FinishReason
from sits.core.structured_outputs import StructuredOutputsParams
from sits.engine.grammar_gate import GrammarGate
from sits.engine.output_processor import make_engine_requests

SPEC = StructuredOutputsParams(regex=r"[0-9]{5}")


class _SlowCache:
    """A grammar cache whose compiles end when the test says (`finish`)."""

    def __init__(self, real) -> None:
        self.real = real
        self.futures: list[Future] = []

    def submit(self, spec: StructuredOutputsParams) -> Future:
        future: Future = Future()
        self.futures.append(future)
        return future

    def finish(self, spec: StructuredOutputsParams) -> None:
        for future in self.futures:
            future.set_result(self.real.get(spec))


@pytest.fixture
def core_and_cache(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("qwen3")), dtype="float32", max_model_len=256)
    core = llm.engine_core
    cache = _SlowCache(core.runner.grammar_rows.cache)
    core.grammar_gate = GrammarGate(lambda: cache)
    return llm, core, cache


def _request(llm: LLM, request_id: str, params: SamplingParams):
    return make_engine_requests(
        request_id,
        [5, 6, 7, 8],
        params,
        eos_token_ids=llm.info.eos_token_ids,
        max_model_len=256,
        enable_prefix_caching=True,
    )[0]


def _tokens_by_request(outputs) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for out in outputs:
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    return got


def test_other_requests_run_while_a_grammar_compiles(core_and_cache) -> None:
    llm, core, cache = core_and_cache
    core.add_request(_request(llm, "c", SamplingParams(temperature=0, structured_outputs=SPEC)))
    core.add_request(_request(llm, "u", SamplingParams(temperature=0, max_tokens=4)))
    assert "c" in core.grammar_gate and core.scheduler.get_request("c") is None
    steps = [core.step() for _ in range(3)]
    tokens = _tokens_by_request(o for outputs in steps for o in outputs)
    assert len(tokens["u"]) == 3 and "c" not in tokens
    cache.finish(SPEC)
    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(core.step())
    assert not core.grammar_gate
    text = llm.get_tokenizer().decode(_tokens_by_request(outputs)["c"])
    assert re.fullmatch(r"[0-9]{5}", text)


def test_a_held_request_aborts(core_and_cache) -> None:
    llm, core, _ = core_and_cache
    core.add_request(_request(llm, "c", SamplingParams(structured_outputs=SPEC)))
    outputs = core.finish_requests(["c"], FinishReason.ABORT)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("c", FinishReason.ABORT)]
    assert not core.grammar_gate and not core.has_unfinished_requests()


def test_a_failed_compile_finishes_with_error(core_and_cache) -> None:
    llm, core, cache = core_and_cache
    core.add_request(_request(llm, "c", SamplingParams(structured_outputs=SPEC)))
    cache.futures[0].set_exception(InvalidParameterError("structured_outputs", "boom"))
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("c", FinishReason.ERROR)]
    assert "boom" in outputs[0].error
    assert not core.has_unfinished_requests()


def test_a_request_that_cannot_fit_fails_at_add(core_and_cache) -> None:
    llm, core, _ = core_and_cache
    params = SamplingParams(max_tokens=1000, structured_outputs=SPEC)
    with pytest.raises(InvalidParameterError):
        core.add_request(_request(llm, "c", params))
    assert not core.grammar_gate
