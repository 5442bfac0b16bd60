"""Structured outputs through the engine (`LLM`): outputs parse and validate against their
constraint, unconstrained rows of a mixed batch keep their exact tokens, and preemption,
async scheduling and max_tokens behave.

Model: a tiny random qwen3 checkpoint (vocab 512, its own byte-level BPE tokenizer), so the
grammar alone shapes the outputs. The random schemas bound every value (string lengths,
integer and number ranges, array sizes) so that the outputs end well within max_tokens; the
whitespace between JSON tokens is free (xgrammar's default, as vLLM's).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest

import sits
from sits import LLM, SamplingParams
from sits.core.errors import InvalidParameterError
from sits.core.structured_outputs import StructuredOutputsParams
from tests.engine.hf_reference import random_prompts

NUM_SCHEMAS = 24
DEMO_MODEL_DIR = str(Path(sits.__file__).parent / "demo_model")
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=512)


def _property_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"])
    if kind == "string":
        # A pattern, not maxLength: xgrammar 0.2.9 lets a length-bounded string hold control
        # characters, which strict JSON parsers refuse.
        return {"type": "string", "pattern": f"^[a-z ]{{{rng.randint(0, 2)},{rng.randint(2, 6)}}}$"}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x y", "é"], rng.randint(1, 4))}
    if kind == "array":
        items = {"type": rng.choice(["boolean", "integer"])}
        if items["type"] == "integer":
            items.update(minimum=0, maximum=9)
        return {"type": "array", "items": items, "minItems": 0, "maxItems": rng.randint(1, 3)}
    if depth > 0:
        return _property_schema(rng, depth)
    return random_schema(rng, depth + 1)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 bounded properties (string, integer, number, boolean, enum,
    array, nested object), some of them required."""
    names = rng.sample(["name", "age", "score", "ok", "color", "tags", "child", "id"], 4)
    props = {n: _property_schema(rng, depth) for n in names[: rng.randint(1, 4)]}
    required = [n for n in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required}


def _prompts(n: int, seed: int) -> list[dict]:
    lengths = [3 + (5 * i) % 17 for i in range(n)]
    return [{"prompt_token_ids": p} for p in random_prompts(lengths, 512, seed=seed)]


@pytest.mark.parametrize(
    ("temperature", "disable_any_whitespace"), [(0.0, True), (1.0, True), (1.0, False)]
)
def test_random_schemas_parse_and_validate(
    llm: LLM, temperature: float, disable_any_whitespace: bool
) -> None:
    """Every finished output validates. With free whitespace a random model may write spaces
    until max_tokens (greedy, it always does: the case is left out); those few end "length"
    with a valid JSON prefix."""
    rng = random.Random(29 + int(temperature))
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(
                json=schema, disable_any_whitespace=disable_any_whitespace
            ),
        )
        for i, schema in enumerate(schemas)
    ]
    outs = llm.generate(_prompts(NUM_SCHEMAS, seed=3), params)
    num_stopped = 0
    for schema, out in zip(schemas, outs):
        sample = out.outputs[0]
        if sample.finish_reason == "length":
            assert not disable_any_whitespace, (schema, sample.text)
            assert len(sample.token_ids) == MAX_TOKENS
            continue
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), schema)
        num_stopped += 1
    assert num_stopped >= (NUM_SCHEMAS if disable_any_whitespace else NUM_SCHEMAS - 4)


def test_regex_choice_grammar(llm: LLM) -> None:
    specs = {
        "regex": StructuredOutputsParams(regex=r"[a-z]{2,5}-\d{2}"),
        "choice": StructuredOutputsParams(choice=["yes", "no", "héllo 世界"]),
        "grammar": StructuredOutputsParams(grammar='root ::= "(" [0-9]{1,3} ("," [0-9]+)? ")"'),
    }
    for temperature in (0.0, 1.0):
        params = [
            SamplingParams(temperature=temperature, seed=5, max_tokens=64, structured_outputs=s)
            for s in specs.values()
        ]
        outs = dict(zip(specs, llm.generate(_prompts(len(specs), seed=4), params)))
        texts = {kind: out.outputs[0].text for kind, out in outs.items()}
        assert all(o.outputs[0].finish_reason == "stop" for o in outs.values()), texts
        assert re.fullmatch(r"[a-z]{2,5}-\d{2}", texts["regex"])
        assert texts["choice"] in {"yes", "no", "héllo 世界"}
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]+)?\)", texts["grammar"])


def test_json_object_is_an_object() -> None:
    """On the demo model (a random model's strings run to max_tokens): any JSON object."""
    demo = LLM(model=DEMO_MODEL_DIR, max_model_len=512)
    spec = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    prompts = ["config = ", "def f(x):\n    return", "data = {"]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=200,
                                structured_outputs=spec)  # fmt: skip
        for out in demo.generate(prompts, params):
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            assert isinstance(json.loads(out.outputs[0].text), dict)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_unconstrained_rows_unchanged_by_constrained_ones(llm: LLM, temperature: float) -> None:
    prompts = _prompts(6, seed=7)
    plain = [SamplingParams(temperature=temperature, seed=100 + i, max_tokens=24) for i in range(6)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9a-f]{6,30}"),
        )
        for i in range(6)
    ]
    mixed_prompts = [p for pair in zip(prompts, _prompts(6, seed=8)) for p in pair]
    mixed_params = [p for pair in zip(plain, constrained) for p in pair]
    outs = llm.generate(mixed_prompts, mixed_params)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == alone
    for out in outs[1::2]:  # the constrained rows did run constrained
        assert re.fullmatch(r"[0-9a-f]{6,30}", out.outputs[0].text)


def test_max_tokens_before_the_grammar_ends_is_length(llm: LLM) -> None:
    spec = StructuredOutputsParams(regex=r"a{50}")
    out = llm.generate(
        _prompts(1, seed=9), SamplingParams(temperature=0, max_tokens=5, structured_outputs=spec)
    )[0]
    sample = out.outputs[0]
    assert sample.finish_reason == "length"
    assert len(sample.token_ids) == 5
    assert re.fullmatch(r"a+", sample.text) and len(sample.text) < 50  # the partial output


def test_min_tokens_does_not_outlast_the_grammar(llm: LLM) -> None:
    spec = StructuredOutputsParams(choice=["ok"])
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs=spec)
    sample = llm.generate(_prompts(1, seed=10), params)[0].outputs[0]
    assert (sample.text, sample.finish_reason) == ("ok", "stop")


def test_ignore_eos_ends_with_the_grammar(llm: LLM) -> None:
    spec = StructuredOutputsParams(regex=r"xy")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=spec)
    sample = llm.generate(_prompts(1, seed=10), params)[0].outputs[0]
    assert (sample.text, sample.finish_reason) == ("xy", "stop")


def test_invalid_spec_is_refused_before_the_engine(llm: LLM) -> None:
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "foo"}}})
    with pytest.raises(InvalidParameterError, match="foo") as info:
        llm.generate(_prompts(1, seed=1), SamplingParams(structured_outputs=bad))
    assert info.value.param == "structured_outputs"
    assert not llm.engine_core.has_unfinished_requests()


def _long_specs(n: int) -> list[StructuredOutputsParams]:
    return [StructuredOutputsParams(regex=rf"[a-z]{{{30 + 3 * i}}}") for i in range(n)]


def test_preempted_constrained_requests_resume_their_grammar(model_dir) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * head_dim * 4
    prompts = _prompts(8, seed=12)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=80, structured_outputs=spec
        )
        for i, spec in enumerate(_long_specs(8))
    ]
    roomy = LLM(model=str(model_dir), dtype="float32", max_model_len=512)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    small = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=14 * block_bytes,
    )
    for spec in _long_specs(8):  # compiled first: all start together, so some are preempted
        small.engine_core.runner.grammar_rows.cache.get(spec)
    outs = small.generate(prompts, params)
    assert small.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for i, out in enumerate(outs):
        assert re.fullmatch(rf"[a-z]{{{30 + 3 * i}}}", out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"


def test_async_scheduling_gives_the_same_outputs(model_dir) -> None:
    prompts = _prompts(6, seed=13)
    params = [
        SamplingParams(
            temperature=0.7,
            seed=i,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{4,12}") if i % 3 else None,
        )
        for i in range(6)
    ]
    outs = {}
    for async_scheduling in (False, True):
        engine = LLM(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            async_scheduling=async_scheduling,
        )
        outs[async_scheduling] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_two_tensor_parallel_ranks_give_the_same_constrained_tokens(model_dir) -> None:
    """Each rank keeps its own matchers (the worker compiles the grammar when it first sees
    the request) and masks alike, so rank 0's tokens are one rank's."""
    prompts = _prompts(4, seed=14)
    params = [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(regex=r"[a-f]{3,20}") if i % 2 else None,
        )
        for i in range(4)
    ]
    one_rank = LLM(model=str(model_dir), dtype="float32", max_model_len=256)
    want = [o.outputs[0].token_ids for o in one_rank.generate(prompts, params)]
    tp = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=2,
        tensor_parallel_timeout_s=60.0,
    )
    try:
        outs = tp.generate(prompts, params)
    finally:
        tp.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    for out in outs[1::2]:
        assert re.fullmatch(r"[a-f]{3,20}", out.outputs[0].text)
