"""Logprobs of text whose characters span several tokens (issue 29, fault 1).

Offsets index the returned text, a token that completes no character takes its character's
offset, the first generated offset is the prompt's length, partial UTF-8 shows as vLLM's
"bytes:\\xNN" form, distinct tokens never share a `top_logprobs` key, and chat entries carry
each token's own bytes.
"""

from __future__ import annotations

import codecs
import re

import pytest

from sits.core.outputs import Logprob
from sits.demo import packaged_demo_dir
from sits.engine.tokenizer import Tokenizer
from sits.server.logprobs import CompletionLogprobsBuilder, chat_logprobs_content, token_text

PROMPT = "x = 'héllo 世界 🙂'\n"


def _raw(token: str) -> bytes:
    """The bytes a token text of the logprobs stands for ("bytes:\\xNN..." or characters)."""
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode("utf-8")


def _whole_characters(raw: bytes) -> str:
    """The text of `raw` less a trailing partial character (invalid bytes are U+FFFD)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(raw)
    pending = len(decoder.getstate()[0])
    return raw[: len(raw) - pending].decode("utf-8", errors="replace")


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """The tokens' bytes make `text`, and each offset is the index in `text` of the character
    holding the token's first byte: the text before it is what the earlier tokens complete."""
    assert b"".join(_raw(t) for t in tokens).decode("utf-8", errors="replace") == text
    before = b""
    for token, offset in zip(tokens, offsets, strict=True):
        assert text[:offset] == _whole_characters(before), (token, offset)
        before += _raw(token)


def test_demo_prompt_offsets_and_token_texts() -> None:
    tokenizer = Tokenizer(packaged_demo_dir())
    ids = tokenizer.encode(PROMPT)
    out = CompletionLogprobsBuilder(tokenizer, 1, 0).build(ids, [None] * len(ids))
    assert len(PROMPT) == 17
    assert out.tokens[3:6] == ["h", "bytes:\\xc3", "bytes:\\xa9"]
    assert out.text_offset == [0, 1, 3, 5, 6, 6, 7, 8, 10, 11, 11, 11, 12, 12, 12, 13, 14, 14, 14,
                               15, 16]  # fmt: skip
    _check_offsets(PROMPT, out.tokens, out.text_offset)


class _SameBytes:
    """Ids 1 and 2 are both "A" (a byte-fallback piece and a normal one); 3 is byte 0xe4."""

    all_special_ids = [0]

    def token_bytes(self, token_id: int) -> bytes:
        return {0: b"<eos>", 1: b"A", 2: b"A", 3: b"\xe4"}[token_id]


def test_distinct_tokens_never_share_a_key() -> None:
    entry = {2: Logprob(-0.5, 1), 1: Logprob(-1.0, 2), 3: Logprob(-2.0, 3)}
    out = CompletionLogprobsBuilder(_SameBytes(), 3, 0).build([1], [entry])
    assert out.top_logprobs == [{"A": -1.0, "token_id:2": -0.5, "bytes:\\xe4": -2.0}]
    assert token_text(b"\xf0\x9f") == "bytes:\\xf0\\x9f"


def test_skipped_special_tokens_advance_no_offset() -> None:
    builder = CompletionLogprobsBuilder(_SameBytes(), 0, 4, skip_ids=[0])
    out = builder.build([1, 0, 1], [None] * 3)
    assert out.text_offset == [4, 5, 5]
    assert out.tokens == ["A", "<eos>", "A"]


def test_chat_entries_carry_the_tokens_bytes() -> None:
    entry = {3: Logprob(-0.1, 1), 1: Logprob(-3.0, 2)}
    (item,) = chat_logprobs_content([3], [entry], 2, _SameBytes())
    assert (item.token, item.bytes) == ("bytes:\\xe4", [0xE4])
    assert [(a.token, a.bytes) for a in item.top_logprobs] == [("bytes:\\xe4", [0xE4]), ("A", [65])]


@pytest.mark.parametrize("max_tokens", [0, 1, 3, 5])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_of_multibyte_prompt(client, model_name, max_tokens, stream) -> None:
    kwargs = dict(
        model=model_name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        offsets = [o for p in parts for o in p.text_offset]
        tops = [t for p in parts for t in p.top_logprobs]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, lp = choice.text, choice.logprobs
        tokens, offsets, tops = lp.tokens, lp.text_offset, lp.top_logprobs
    assert text.startswith(PROMPT)
    assert any(t.startswith("bytes:") for t in tokens)  # the tiny tokenizer splits characters
    _check_offsets(text, tokens, offsets)
    num_prompt = len(tokens) - max_tokens
    if max_tokens:
        assert offsets[num_prompt] == len(PROMPT)
    for token, top in zip(tokens[1:], tops[1:], strict=True):
        assert token in top  # the chosen token under its own text
        assert len(top) <= 2


def test_completion_without_echo_starts_at_the_prompt_length(client, model_name) -> None:
    out = client.completions.create(
        model=model_name, prompt=PROMPT, logprobs=2, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert lp.text_offset[0] == len(PROMPT)
    _check_offsets(PROMPT + out.choices[0].text, [PROMPT, *lp.tokens], [0, *lp.text_offset])


def test_chat_logprobs_bytes_join_to_the_content(client, model_name) -> None:
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": PROMPT}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode("utf-8", errors="replace") == choice.message.content
    for entry in content:
        assert _raw(entry.token) == bytes(entry.bytes)
        assert all(_raw(alt.token) == bytes(alt.bytes) for alt in entry.top_logprobs)
