"""Engine logprobs (`dict[token_id, Logprob]` per position) in OpenAI's two wire shapes.

- Completions (legacy): aligned lists `tokens`, `token_logprobs`, `top_logprobs` (token text ->
  logprob, the chosen token plus the top N) and `text_offset`.
- Chat: one `{token, logprob, bytes, top_logprobs}` per generated token, where `top_logprobs`
  holds exactly the N most likely tokens in rank order (the chosen token appears there only if
  it is among them).
JSON has no -inf: logprobs are clamped to -9999.0 (as vLLM does). A position without logprobs
(the first prompt token) has null logprob and null top_logprobs.
"""

from __future__ import annotations

import math

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


def _token_text(token_id: int, entry: PositionLogprobs, tokenizer: ServerTokenizer) -> str:
    if entry is not None:
        found = entry.get(token_id)
        if found is not None and found.decoded_token is not None:
            return found.decoded_token
    return tokenizer.decode_token(token_id)


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
        tokenizer: decodes token text when the engine did not.
        num_top: N, the number of alternatives asked for.
        initial_offset: text_offset of the first token (the prompt's length when not echoed).
    """

    def __init__(self, tokenizer: ServerTokenizer, num_top: int, initial_offset: int) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.offset = initial_offset

    def build(self, token_ids: list[int], entries: list[PositionLogprobs]) -> CompletionLogprobs:
        """Logprobs of `token_ids` (one entry per token; None where there is none)."""
        assert len(token_ids) == len(entries), (len(token_ids), len(entries))
        out = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = _token_text(token_id, entry, self.tokenizer)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            chosen = entry.get(token_id)
            out.token_logprobs.append(None if chosen is None else _finite(chosen.logprob))
            top: dict[str, float] = {}
            for alt_id, alt in top_n(entry, self.num_top):
                top.setdefault(_token_text(alt_id, entry, self.tokenizer), _finite(alt.logprob))
            if chosen is not None:
                top.setdefault(text, _finite(chosen.logprob))
            out.top_logprobs.append(top)
        return out


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
        tokenizer: decodes token text when the engine did not.
    """
    assert len(token_ids) == len(entries), (len(token_ids), len(entries))
    content: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(token_id, entry, tokenizer)
        chosen = None if entry is None else entry.get(token_id)
        alternatives = []
        for alt_id, alt in top_n(entry or {}, num_top):
            alt_text = _token_text(alt_id, entry, tokenizer)
            alternatives.append(
                TopLogprob(
                    token=alt_text,
                    logprob=_finite(alt.logprob),
                    bytes=list(alt_text.encode("utf-8")),
                )
            )
        content.append(
            TokenLogprob(
                token=text,
                logprob=MIN_LOGPROB if chosen is None else _finite(chosen.logprob),
                bytes=list(text.encode("utf-8")),
                top_logprobs=alternatives,
            )
        )
    return content
