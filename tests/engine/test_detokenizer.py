"""Incremental detokenization and stop strings (C01, C02) against whole-sequence decoding."""

from __future__ import annotations

import random

import pytest

from sits.core.sampling_params import SamplingParams
from sits.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from sits.testing.tokenizer import save_tiny_tokenizer

MULTILINGUAL = "Hi! Café 你好，世界。こんにちは 😀🚀 Straße ok 👨‍👩‍👧‍👦 end"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok512")
    save_tiny_tokenizer(path, 512)
    return Tokenizer(path)


@pytest.fixture(scope="module")
def tok_big(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok8000")
    save_tiny_tokenizer(path, 8000)
    return Tokenizer(path)


def stream(
    tok: Tokenizer,
    output_ids: list[int],
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed tokens one by one as the engine does; return the deltas and the stop string."""
    detok = IncrementalDetokenizer(tok, prompt_ids or [], params)
    deltas: list[str] = []
    stop = None
    for token_id in output_ids:
        stop = detok.update([token_id])
        if stop is not None:
            break
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop, detok


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_sequences_match_whole_decode(tok: Tokenizer, skip_special_tokens) -> None:
    rng = random.Random(0)
    pieces = tok.encode(MULTILINGUAL)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(150):
        length = rng.randint(1, 30)
        # Mostly real pieces (multi-byte characters split over tokens), some arbitrary ids.
        ids = [
            rng.choice(pieces) if rng.random() < 0.7 else rng.randrange(tok.vocab_size)
            for _ in range(length)
        ]
        prompt = tok.encode("User: hello there\n")
        deltas, stop, detok = stream(tok, ids, params, prompt)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert stop is None
        assert "".join(deltas) == expected == detok.output_text


def test_multibyte_characters_never_streamed_partially(tok: Tokenizer) -> None:
    ids = tok.encode(MULTILINGUAL)
    assert "\ufffd" in [tok.decode_token(i) for i in ids]  # some characters span tokens
    deltas, _, detok = stream(tok, ids, SamplingParams(), tok.encode("Q: "))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTILINGUAL == detok.output_text
    # Streaming emitted nothing for at least one token (a character waited for its last byte).
    assert "" in deltas[:-1]


def test_pending_partial_character_flushed_at_the_end(tok: Tokenizer) -> None:
    emoji = tok.encode("😀")
    assert len(emoji) >= 2
    ids = tok.encode("ok ") + emoji[:-1]  # generation stops in the middle of the emoji
    deltas, _, detok = stream(tok, ids, SamplingParams())
    assert "".join(deltas[:-1]) == "ok "
    assert deltas[-1] == tok.decode(ids)[3:]
    assert deltas[-1] and set(deltas[-1]) == {"\ufffd"}
    assert detok.output_text == tok.decode(ids)


def test_prompt_context_keeps_sentencepiece_leading_space() -> None:
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "▁Hello": 2, "▁world": 3, "▁how": 4, "▁are": 5, "▁you": 6}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>"))
    assert tok.decode([3, 4]) == "world how"  # a whole decode strips the first space
    deltas, _, detok = stream(tok, [3, 4, 5, 6], SamplingParams(), prompt_ids=[2])
    assert deltas[:4] == [" world", " how", " are", " you"]
    assert detok.output_text == " world how are you"


def test_stop_string_across_tokens_c01(tok: Tokenizer) -> None:
    text = "The answer is 42. Observation: nothing more to say"
    ids = tok.encode(text)
    stop = "Observation:"
    # The stop string is produced over several tokens at this vocabulary size.
    assert len(tok.encode(stop)) >= 3
    deltas, matched, detok = stream(tok, ids, SamplingParams(stop=[stop]))
    expected = text[: text.index(stop)]
    assert matched == stop == detok.stop_reason
    assert "".join(deltas) == expected == detok.output_text
    # At no point did the stream reach into the stop string (not even its first character).
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert expected.startswith(streamed)


def test_stop_string_inside_one_token(tok_big: Tokenizer) -> None:
    ids = tok_big.encode("Hello world")
    assert tok_big.convert_ids_to_tokens(ids)[0] == "Hello"
    deltas, matched, detok = stream(tok_big, ids, SamplingParams(stop=["ell"]))
    assert matched == "ell"
    assert "".join(deltas) == "H" == detok.output_text
    deltas, matched, detok = stream(
        tok_big, ids, SamplingParams(stop=["ell"], include_stop_str_in_output=True)
    )
    assert "".join(deltas) == "Hell" == detok.output_text  # text after the match is dropped


def test_earliest_completed_stop_wins(tok_big: Tokenizer) -> None:
    ids = tok_big.encode("Hello world")
    # Both complete inside the token "Hello": "ell" ends first.
    _, matched, detok = stream(tok_big, ids, SamplingParams(stop=["Hello", "ell"]))
    assert (matched, detok.output_text) == ("ell", "H")
    # Both end at the same character: the one starting earlier is cut.
    _, matched, detok = stream(tok_big, ids, SamplingParams(stop=["lo", "llo"]))
    assert (matched, detok.output_text) == ("llo", "He")
    ids = tok_big.encode("abc def ghi jkl")
    _, matched, detok = stream(tok_big, ids, SamplingParams(stop=["ghi", "def", "zzz"]))
    assert (matched, detok.output_text) == ("def", "abc ")


def test_include_stop_str_in_output_across_tokens(tok: Tokenizer) -> None:
    text = "Say STOPWORD then more"
    ids = tok.encode(text)
    params = SamplingParams(stop=["STOPWORD"], include_stop_str_in_output=True)
    deltas, matched, detok = stream(tok, ids, params)
    assert matched == "STOPWORD"
    assert "".join(deltas) == "Say STOPWORD" == detok.output_text


def test_held_back_text_flushed_when_ending_by_length_c02(tok: Tokenizer) -> None:
    stop = "THE END OF THE STORY"
    text = "Once upon a time THE END OF"  # the stop's beginning, then max_tokens is reached
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[stop]))
    streamed = ""
    for token_id in ids:
        assert detok.update([token_id]) is None
        streamed += detok.get_delta(finished=False)
    # While running, exactly len(stop) - 1 characters are held back.
    assert streamed == text[: len(text) - (len(stop) - 1)]
    last = detok.get_delta(finished=True)
    assert streamed + last == text == detok.output_text
    assert detok.get_delta(finished=True) == ""


def test_no_stop_strings_streams_everything_at_once(tok: Tokenizer) -> None:
    ids = tok.encode("abc def")
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    detok.update(ids)
    assert detok.get_delta(finished=False) == "abc def"
    assert detok.get_delta(finished=True) == ""


def test_tokens_after_a_stop_are_ignored(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["two"]))
    assert detok.update(ids) == "two"  # all tokens at once: the match is still found
    assert detok.output_text == "one "
    assert detok.update(tok.encode(" five")) is None
    assert detok.get_delta(finished=False) == "one "
    assert detok.output_text == "one "


def test_stop_terminated_token_kept_out_of_text(tok: Tokenizer) -> None:
    ids = tok.encode("bye") + [2]  # ends with <|im_end|> as a stop token
    params = SamplingParams(skip_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids, stop_terminated=True)
    assert detok.get_delta(finished=True) == "bye"
    detok = IncrementalDetokenizer(tok, [], params)
    detok.update(ids)
    assert detok.get_delta(finished=True) == "bye<|im_end|>"


def test_stop_strings_on_random_streams(tok: Tokenizer) -> None:
    """Random texts and stops: streamed == final text == text cut at the first completion."""
    rng = random.Random(1)
    words = ["alpha", "beta", "gamma", "你好", "😀", "Straße", "stop", "sto", "p!", "\n"]
    for _ in range(100):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        stops = [rng.choice(["stop", "p! ", "a b", "你好 😀", "gamma\n", "zz"])]
        if rng.random() < 0.5:
            stops.append(rng.choice(["beta", "ta g", "好"]))
        include = rng.random() < 0.3
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        deltas, matched, detok = stream(tok, tok.encode(text), params)
        ends = {s: text.find(s) + len(s) for s in stops if s in text}
        if ends:
            first_end = min(ends.values())
            best = min(
                (s for s, e in ends.items() if e == first_end), key=lambda s: first_end - len(s)
            )
            assert matched == best
            expected = text[:first_end] if include else text[: first_end - len(best)]
        else:
            assert matched is None
            expected = text
        assert "".join(deltas) == expected == detok.output_text
