"""Unit tests of the server's pure pieces: parameter mapping, logprob shapes, errors, auth."""

from __future__ import annotations

import math

import pytest

from sits.core.errors import EngineDeadError, InvalidParameterError
from sits.core.outputs import Logprob
from sits.core.sampling_params import RequestOutputKind
from sits.server.errors import ServerError, to_server_error
from sits.server.logprobs import (
    MIN_LOGPROB,
    CompletionLogprobsBuilder,
    chat_logprobs_content,
    top_n,
)
from sits.server.params import (
    chat_max_tokens_field,
    chat_sampling_params,
    check_chat_request,
    check_completion_request,
    completion_sampling_params,
)
from sits.server.protocol_chat import ChatCompletionRequest
from sits.server.protocol_completion import CompletionRequest
from sits.server.qos.admit import keys_match
from sits.server.serving_common import drop_double_bos


class _Tok:
    """Token id i is the bytes of "t{i}"; id 9 is "x"."""

    all_special_ids: list[int] = []

    def token_bytes(self, token_id: int) -> bytes:
        return b"x" if token_id == 9 else f"t{token_id}".encode()


def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_completion_params_mapping() -> None:
    req = CompletionRequest(
        prompt="x", echo=True, logprobs=2, top_k=5, stop="END", seed=3, temperature=0
    )
    params = completion_sampling_params(req, 7)
    assert params.max_tokens == 7 and params.logprobs == 2 and params.prompt_logprobs == 2
    assert params.top_k == 5 and params.stop == ["END"] and params.seed == 3
    assert params.temperature == 0 and params.top_p == 1.0
    assert params.output_kind is RequestOutputKind.DELTA
    defaults = completion_sampling_params(CompletionRequest(prompt="x"), 16)
    assert defaults.temperature == 1.0 and defaults.logprobs is None
    assert defaults.prompt_logprobs is None


def test_chat_params_mapping() -> None:
    assert chat_sampling_params(_chat(logprobs=True, top_logprobs=5), None).logprobs == 5
    assert chat_sampling_params(_chat(logprobs=True), None).logprobs == 0
    assert chat_sampling_params(_chat(), None).logprobs is None
    req = _chat(max_tokens=10, max_completion_tokens=20)
    assert chat_max_tokens_field(req) == ("max_completion_tokens", 20)
    assert chat_max_tokens_field(_chat(max_tokens=10)) == ("max_tokens", 10)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_special_tokens": True}, "add_special_tokens"),
    ],
)
def test_chat_refusals(fields, param) -> None:
    with pytest.raises((ServerError, InvalidParameterError)) as err:
        check_chat_request(_chat(**fields))
    assert err.value.param == param


def test_chat_accepts_harmless_settings() -> None:
    check_chat_request(
        _chat(tool_choice="none", response_format={"type": "text"}, modalities=["text"], user="u")
    )


def test_completion_best_of() -> None:
    check_completion_request(CompletionRequest(prompt="x", n=2, best_of=2))
    for best_of in (1, 3):
        with pytest.raises(ServerError) as err:
            check_completion_request(CompletionRequest(prompt="x", n=2, best_of=best_of))
        assert err.value.param == "best_of" and err.value.status == 400


def test_top_n_uses_ranks_and_leaves_out_a_low_chosen_token() -> None:
    entry = {
        7: Logprob(-5.0, rank=9),  # the chosen token, outside the top 2
        1: Logprob(-0.5, rank=1),
        2: Logprob(-1.5, rank=2),
    }
    assert [tid for tid, _ in top_n(entry, 2)] == [1, 2]
    assert top_n(entry, 0) == []
    no_ranks = {3: Logprob(-2.0), 4: Logprob(-1.0)}
    assert [tid for tid, _ in top_n(no_ranks, 1)] == [4]


def test_chat_logprobs_content_shape() -> None:
    entries = [{5: Logprob(-0.1, 1), 6: Logprob(-3.0, 2), 8: Logprob(-4.0, 3)}]
    (item,) = chat_logprobs_content([5], entries, 2, _Tok())
    assert item.token == "t5" and item.logprob == -0.1 and item.bytes == list(b"t5")
    assert [(a.token, a.logprob) for a in item.top_logprobs] == [("t5", -0.1), ("t6", -3.0)]


def test_completion_logprobs_offsets_and_clamping() -> None:
    builder = CompletionLogprobsBuilder(_Tok(), 1, initial_offset=10)
    first = builder.build([5, 6], [None, {6: Logprob(-math.inf, 3), 9: Logprob(-0.2, 1)}])
    assert first.tokens == ["t5", "t6"] and first.text_offset == [10, 12]
    assert first.token_logprobs == [None, MIN_LOGPROB]
    assert first.top_logprobs == [None, {"x": -0.2, "t6": MIN_LOGPROB}]
    second = builder.build([7], [{7: Logprob(-1.0, 1)}])
    assert second.text_offset == [14]  # offsets carry over between stream chunks


def test_error_mapping() -> None:
    err = to_server_error(InvalidParameterError("top_p", "bad top_p"))
    assert (err.status, err.param, err.type) == (400, "top_p", "invalid_request_error")
    dead = to_server_error(EngineDeadError("gone"))
    assert dead.status == 503 and dead.code == "engine_dead"
    boom = to_server_error(RuntimeError("secret detail"))
    assert boom.status == 500 and "secret detail" not in boom.message


def test_keys_match_and_double_bos() -> None:
    assert keys_match("abc", "abc")
    assert not keys_match("abc", "abd") and not keys_match("abc", None)
    assert not keys_match("abc", "ab")
    assert drop_double_bos([1, 1, 5], 1) == [1, 5]
    assert drop_double_bos([1, 5], 1) == [1, 5]
    assert drop_double_bos([1, 1, 5], None) == [1, 1, 5]
