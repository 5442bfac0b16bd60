"""`IncrementalDetokenizer`: one sequence's token ids to text, step by step, with stop strings.

Decoding uses the prefix/read-offset method (as in Hugging Face text-generation-inference):
each step decodes a short window that starts a few tokens back (`prefix_offset`) both without
and with the new tokens and keeps the difference. The window's left context makes tokenizers
that strip or add spaces at a sequence start (SentencePiece "▁", WordPiece "##") produce the
same text as decoding the whole sequence. Invariants:
- no partial UTF-8 character is ever added to the text: while the window's text ends with
  U+FFFD the new tokens wait (a character split over several byte tokens appears whole);
  `flush()` (called by `get_delta(finished=True)`) adds whatever is still pending, U+FFFD
  included, so the final text equals a whole-sequence decode.
- stop strings are matched in the text, across token boundaries and inside one token; the
  match kept is the one that completes first (earliest end, then earliest start): the same
  result whatever the tokenization. The text is cut at the match's start (or its end with
  `include_stop_str_in_output`) and later tokens are ignored.
- `get_delta` holds back the last (longest stop string - 1) characters until the request
  finishes, so no streamed delta ever contains part of a matched stop string, and the joined
  deltas equal `output_text` once finished (cases C01, C02).

`tokenizers.decoders.DecodeStream` does the same window decoding in Rust, but it cannot flush
pending bytes at the end and its prompt-prefix argument exists only in recent `tokenizers`
releases, so the window method is kept here in a few lines of Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from sits.core.sampling_params import SamplingParams
from sits.engine.tokenizer import Tokenizer

# Prompt tokens kept as left context of the first decode window.
_NUM_PROMPT_CONTEXT_TOKENS = 6
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text as they arrive.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; its last few tokens give the first window's context.
        params: the request's sampling parameters (stop, include_stop_str_in_output,
            skip_special_tokens).

    Attributes:
        stop_reason: the stop string that matched, or None.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stop = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        max_stop_chars = max((len(s) for s in self._stop), default=0)
        # Characters that may still turn out to start a stop string (removed on a match).
        self._num_holdback_chars = 0 if self._include_stop else max(max_stop_chars - 1, 0)
        context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._token_ids: list[int] = context  # context + generated ids, decode windows index it
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._num_sent_chars = 0
        self._finished = False
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """All text so far (after a stop match: cut at the match)."""
        return self._text

    @property
    def finished(self) -> bool:
        """True after a stop string matched or `flush()` ran; later tokens are ignored."""
        return self._finished

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Add newly generated tokens to the text and check the stop strings.

        Args:
            new_token_ids: tokens generated since the last call, in order.
            stop_terminated: the last id ended the request (EOS or a stop token id); it is kept
                out of the text, as vLLM does.

        Returns:
            The stop string that matched (the text is then cut and the detokenizer finished),
            or None.
        """
        if self._finished:
            return None
        token_ids = list(new_token_ids[:-1] if stop_terminated else new_token_ids)
        for token_id in token_ids:
            num_old_chars = len(self._text)
            self._token_ids.append(token_id)
            self._text += self._decode_step()
            if self._stop and len(self._text) > num_old_chars:
                stop = self._check_stop(num_old_chars)
                if stop is not None:
                    return stop
        return None

    def flush(self) -> None:
        """Add any pending text (an incomplete character decodes to U+FFFD) and finish."""
        if self._finished:
            return
        self._finished = True
        if self._read_offset < len(self._token_ids):
            prefix_text = self._decode(self._prefix_offset, self._read_offset)
            text = self._decode(self._prefix_offset, len(self._token_ids))
            self._text += text[len(prefix_text) :]
            self._read_offset = len(self._token_ids)

    def get_delta(self, finished: bool) -> str:
        """Text added since the last call.

        Args:
            finished: the request has ended (stop, length, EOS, abort): everything pending and
                held back is flushed.

        Returns:
            New text; while not finished, the last (longest stop string - 1) characters are
            held back so a stop string's beginning is never streamed.
        """
        if finished:
            self.flush()
            end = len(self._text)
        elif self._finished:  # a stop string matched: the text is final
            end = len(self._text)
        else:
            end = max(len(self._text) - self._num_holdback_chars, self._num_sent_chars)
        delta = self._text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _decode_step(self) -> str:
        """New complete text of the window, advancing the offsets; "" while incomplete."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(text) <= len(prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return text[len(prefix_text) :]

    def _check_stop(self, num_old_chars: int) -> str | None:
        """Find the first stop string completed by text after `num_old_chars`; cut the text."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stop:
            start = self._text.find(stop, max(num_old_chars - len(stop) + 1, 0))
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        cut = end if self._include_stop else start
        assert cut >= self._num_sent_chars, "text cut by a stop string was already streamed"
        self._text = self._text[:cut]
        self._finished = True
        self.stop_reason = stop
        return stop
