"""Engine logprobs (`dict[token_id, Logprob]` per position) in OpenAI's two wire shapes.

- Completions (legacy): aligned lists `tokens`, `token_logprobs`, `top_logprobs` (token text ->
  logprob, the chosen token plus the top N) and `text_offset`.
- Chat: one `{token, logprob, bytes, top_logprobs}` per generated token, where `top_logprobs`
  holds exactly the N most likely tokens in rank order (the chosen token appears there only if
  it is among them).
Token texts come from each token's own bytes (`Tokenizer.token_bytes`): whole UTF-8 characters
as themselves, a token holding part of a character as vLLM's (and OpenAI's) "bytes:\\xNN..."
form, so no two distinct byte strings share a text; chat entries carry the bytes themselves.
Invariants of the completion shape:
- `text_offset` indexes the returned text: a token's offset is the index of the character its
  first byte belongs to (a token that completes no character takes its character's offset);
  special tokens the text skips advance nothing; the first generated token's offset is the
  prompt text's length, echoed or not (as OpenAI's).
- distinct token ids never share a `top_logprobs` key: the chosen token keeps its text, an
  alternative whose text is already taken by another id is keyed "token_id:N" (vLLM's form).
JSON has no -inf: logprobs are clamped to -9999.0 (as vLLM does). A position without logprobs
(the first prompt token) has null logprob and null top_logprobs.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Collection

from sits.core.outputs import Logprob
from sits.server.engine_client import ServerTokenizer
from sits.server.protocol_chat import TokenLogprob, TopLogprob
from sits.server.protocol_completion import CompletionLogprobs

MIN_LOGPROB = -9999.0

PositionLogprobs = dict[int, Logprob] | None


def _finite(logprob: float) -> float:
    if math.isnan(logprob):
        return MIN_LOGPROB
    return max(logprob, MIN_LOGPROB)


def token_text(raw: bytes) -> str:
    """The text shown for a token of bytes `raw`: the characters when `raw` is valid UTF-8,
    else "bytes:" and each byte as \\xNN (vLLM's form for partial UTF-8)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def top_n(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely tokens of a position, most likely first.

    Uses the ranks when the engine gave them (the chosen token is in the dict even when it is
    not in the top N; its rank then exceeds N), else the logprobs.
    """
    if num_top <= 0:
        return []
    items = list(entry.items())
    if all(lp.rank is not None for _, lp in items):
        ranked = [(tid, lp) for tid, lp in items if lp.rank <= num_top]  # type: ignore[operator]
        ranked.sort(key=lambda item: (item[1].rank, -item[1].logprob))
        return ranked[:num_top]
    items.sort(key=lambda item: -item[1].logprob)
    return items[:num_top]


class CompletionLogprobsBuilder:
    """Builds legacy completion logprobs, possibly across stream chunks (offsets carry over).

    Args:
        tokenizer: gives each token's bytes.
        num_top: N, the number of alternatives asked for.
        initial_offset: text_offset of the first token (the prompt's length when not echoed).
        skip_ids: token ids the returned text leaves out (the special tokens with
            `skip_special_tokens`): they take an offset but advance it by nothing.
    """

    def __init__(
        self,
        tokenizer: ServerTokenizer,
        num_top: int,
        initial_offset: int,
        skip_ids: Collection[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.skip_ids = frozenset(skip_ids)
        self.restart_at(initial_offset)

    def restart_at(self, offset: int) -> None:
        """Count the next token's offset from character `offset`, with no partial character
        pending (an echoed prompt's end: the completion starts at the prompt's length)."""
        self.offset = offset
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _advance(self, token_id: int, raw: bytes) -> int:
        """The offset of a token of bytes `raw`; moves past the characters it completes."""
        offset = self.offset
        if token_id not in self.skip_ids:
            self.offset += len(self._utf8.decode(raw))
        return offset

    def build(self, token_ids: list[int], entries: list[PositionLogprobs]) -> CompletionLogprobs:
        """Logprobs of `token_ids` (one entry per token; None where there is none)."""
        assert len(token_ids) == len(entries), (len(token_ids), len(entries))
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            raw = self.tokenizer.token_bytes(token_id)
            text = token_text(raw)
            out.tokens.append(text)
            out.text_offset.append(self._advance(token_id, raw))
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            chosen = entry.get(token_id)
            out.token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
            out.top_logprobs.append(self._top(token_id, text, chosen, entry))
        return out

    def build_echo(
        self,
        prompt: tuple[list[int], list[PositionLogprobs], int],
        token_ids: list[int],
        entries: list[PositionLogprobs],
    ) -> CompletionLogprobs:
        """Logprobs of an echoed prompt, then of the generated tokens from the prompt text's
        length on.

        Args:
            prompt: (token ids, entries, length in characters of the echoed prompt text).
            token_ids: the generated tokens; entries: theirs.
        """
        prompt_ids, prompt_entries, prompt_chars = prompt
        out = self.build(prompt_ids, prompt_entries)
        self.restart_at(prompt_chars)
        rest = self.build(token_ids, entries)
        out.tokens += rest.tokens
        out.text_offset += rest.text_offset
        out.token_logprobs += rest.token_logprobs
        out.top_logprobs += rest.top_logprobs
        return out

    def _top(
        self, token_id: int, text: str, chosen: Logprob | None, entry: dict[int, Logprob]
    ) -> dict[str, float]:
        """The top N alternatives and the chosen token, one key per distinct id."""
        owner = {text: token_id}  # the chosen token keeps its own text
        top: dict[str, float] = {}
        for alt_id, alt in top_n(entry, self.num_top):
            key = text if alt_id == token_id else token_text(self.tokenizer.token_bytes(alt_id))
            if owner.setdefault(key, alt_id) != alt_id:
                key = f"token_id:{alt_id}"
            top[key] = _finite(alt.logprob)
        if chosen is not None:
            top.setdefault(text, _finite(chosen.logprob))
        return top


def chat_logprobs_content(
    token_ids: list[int],
    entries: list[PositionLogprobs],
    num_top: int,
    tokenizer: ServerTokenizer,
) -> list[TokenLogprob]:
    """Chat `logprobs.content` entries for generated tokens.

    Args:
        token_ids: the generated tokens.
        entries: one logprobs dict per token (chosen token plus top N).
        num_top: `top_logprobs`, the number of alternatives each entry must carry.
        tokenizer: gives each token's bytes (the entries' `bytes`).
    """
    assert len(token_ids) == len(entries), (len(token_ids), len(entries))
    content: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries):
        raw = tokenizer.token_bytes(token_id)
        chosen = None if entry is None else entry.get(token_id)
        alternatives = []
        for alt_id, alt in top_n(entry or {}, num_top):
            alt_raw = tokenizer.token_bytes(alt_id)
            alternatives.append(
                TopLogprob(
                    token=token_text(alt_raw), logprob=_finite(alt.logprob), bytes=list(alt_raw)
                )
            )
        content.append(
            TokenLogprob(
                token=token_text(raw),
                logprob=MIN_LOGPROB if chosen is None else _finite(chosen.logprob),
                bytes=list(raw),
                top_logprobs=alternatives,
            )
        )
    return content
