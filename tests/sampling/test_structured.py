"""Grammar checks, the compiled-grammar cache and `GrammarRows`' masks on a tiny tokenizer."""

from __future__ import annotations

import pickle

import pytest
import torch
from transformers import AutoTokenizer

from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import SamplingParams
from sits.core.structured_outputs import StructuredOutputsParams
from sits.sampling.grammar import GrammarCache, check_structured_outputs, choice_ebnf
from sits.sampling.structured import GrammarRows
from sits.testing.tokenizer import save_tiny_tokenizer

VOCAB = 512
LOGITS_WIDTH = VOCAB + 40  # an lm_head wider than the tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path, VOCAB)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def cache(tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer, LOGITS_WIDTH, [tokenizer.eos_token_id])


def test_params_are_frozen_hashable_and_pickle() -> None:
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert spec.json == '{"type":"object","properties":{"b":{},"a":{}}}'  # the user's order
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(spec) == hash(StructuredOutputsParams(json=spec.json))
    assert StructuredOutputsParams(choice=["a", "b"]).key == ("choice", '["a", "b"]', False)
    params = SamplingParams(structured_outputs=spec)
    assert pickle.loads(pickle.dumps(params)).structured_outputs == spec


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"regex": "a", "choice": ["a"]}, {"choice": "ab"}, {"choice": []}, {"regex": 3}],
)
def test_params_refuse_no_kind_several_or_bad_types(kwargs: dict) -> None:
    with pytest.raises(InvalidParameterError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"json": '{"type": "foo"}'}, 'Unsupported type "foo"'),
        ({"json": "{not json"}, "invalid json"),
        ({"json": "[1, 2]"}, "must be an object or a bool"),
        ({"json": '{"type": "integer", "minimum": 5, "maximum": 1}'}, "minimum greater"),
        ({"regex": "(unclosed"}, "parenthesis"),
        ({"grammar": "root ::= missing_rule"}, 'Rule "missing_rule" is not defined'),
        ({"structural_tag": "{}"}, "invalid structural_tag"),
    ],
)
def test_check_names_the_field_and_the_reason(kwargs: dict, reason: str) -> None:
    with pytest.raises(InvalidParameterError, match=reason) as info:
        check_structured_outputs(StructuredOutputsParams(**kwargs), "guided_x")
    assert info.value.param == "guided_x"
    assert "/project/" not in str(info.value)  # no C++ file path


def test_choice_ebnf_escapes_quotes_and_keeps_unicode() -> None:
    assert choice_ebnf(['a"b', "é🙂"]) == 'root ::= "a\\"b" | "é🙂"'


def test_cache_compiles_once_per_key(cache: GrammarCache) -> None:
    spec = StructuredOutputsParams(regex="[ab]{3}")
    first = cache.submit(spec)
    assert cache.submit(StructuredOutputsParams(regex="[ab]{3}")) is first
    assert cache.get(spec) is first.result()
    assert cache.submit(StructuredOutputsParams(regex="[ab]{4}")) is not first


def test_cache_drops_a_failed_compile(cache: GrammarCache) -> None:
    bad = StructuredOutputsParams(grammar="root ::= nope")
    with pytest.raises(InvalidParameterError):
        cache.get(bad)
    assert all(key[0] != "grammar" or key[1] != bad.grammar for key in cache._futures)


def _allowed(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_mask_touches_only_constrained_rows_and_extra_ids(tokenizer, cache) -> None:
    rows = GrammarRows(cache)
    rows.add("c", StructuredOutputsParams(choice=["yes", "no"]))
    logits = torch.randn(3, LOGITS_WIDTH)
    before = logits.clone()
    rows.mask(["u0", "c", "u1"], [[], [], []], logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = _allowed(logits[1])
    assert allowed and max(allowed) < VOCAB  # the lm_head's extra ids are never allowed
    starts = {tokenizer.decode([t]) for t in allowed}
    assert all("yes".startswith(s) or "no".startswith(s) for s in starts), starts


def test_accept_ends_on_eos_and_refuses_an_outside_token(tokenizer, cache) -> None:
    rows = GrammarRows(cache)
    spec = StructuredOutputsParams(regex="ab")
    rows.add("r", spec)
    rows.add("s", spec)
    ids = tokenizer.encode("ab")
    for token in ids:
        assert rows.accept(["r"], [token]) == set()
    assert rows.accept(["r", "s"], [tokenizer.eos_token_id, tokenizer.encode("z")[0]]) == {
        "r",
        "s",
    }
    assert rows.num_accepted("r") == len(ids) + 1
    assert rows.num_accepted("s") == 0


def test_mask_brings_the_matcher_level_with_the_outputs(tokenizer, cache) -> None:
    """A matcher that saw tokens the request no longer has rolls back; one behind catches up:
    its mask is the mask of a fresh matcher fed the same outputs."""
    spec = StructuredOutputsParams(regex="[0-9]{2}x")
    digit = tokenizer.encode("7")
    rows = GrammarRows(cache)
    rows.add("r", spec)
    rows.accept(["r"], digit)
    rows.accept(["r"], digit)  # now "77": only "x" may follow
    logits = torch.zeros(1, LOGITS_WIDTH)
    rows.mask(["r"], [digit], logits)  # the request has only "7"
    assert rows.num_accepted("r") == 1
    fresh = GrammarRows(cache)
    fresh.add("f", spec)
    expected = torch.zeros(1, LOGITS_WIDTH)
    fresh.mask(["f"], [digit], expected)  # accepts "7" first
    assert _allowed(logits[0]) == _allowed(expected[0])
    assert tokenizer.encode("x")[0] not in _allowed(logits[0])


def test_rows_drop_forgets(cache) -> None:
    rows = GrammarRows(cache)
    rows.add("r", StructuredOutputsParams(json_object=True))
    assert "r" in rows and len(rows) == 1
    rows.drop("r")
    rows.drop("unknown")
    assert not rows
