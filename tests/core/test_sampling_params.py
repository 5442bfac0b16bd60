"""SamplingParams validation: every invalid value names its parameter."""

from __future__ import annotations

import math

import pytest

from sits import SamplingParams
from sits.core.errors import InvalidParameterError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", 0),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", 0.01),
        ("min_p", math.nan),
        ("presence_penalty", math.inf),
        ("n", 0),
        ("n", 129),
        ("max_tokens", -5),
        ("logprobs", 21),
        ("logprobs", -1),
        ("seed", 1.5),
        ("stop", ["s"] * 65),  # stop conditions are checked on every token: bounded
        ("stop", ["x" * 1025]),
        ("stop_token_ids", list(range(1025))),
    ],
)
def test_invalid_values_name_the_parameter(field: str, value: object) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)


def test_valid_edges() -> None:
    params = SamplingParams(n=128, temperature=0, top_p=1, top_k=-1, logprobs=20, seed=2**70)
    assert params.greedy and params.n == 128
    assert SamplingParams(stop="x").stop == ["x"]
    assert len(SamplingParams(stop=["s"] * 64, stop_token_ids=list(range(1024))).stop) == 64
    assert SamplingParams(stop=["x" * 1024]).stop == ["x" * 1024]
    with pytest.raises(InvalidParameterError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)


@pytest.mark.parametrize("field", ["stop", "stop_token_ids"])
def test_non_list_stop_names_the_parameter(field: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**{field: 123})
    assert info.value.param == field
