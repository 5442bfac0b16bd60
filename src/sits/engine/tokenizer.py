"""Text <-> tokens: `Tokenizer` (text to ids and back) and `IncrementalDetokenizer` (streaming).

`Tokenizer` is a thin wrapper over a transformers tokenizer loaded from a checkpoint directory.
It gives the engine the few operations it needs (encode, decode, chat template, special ids)
with sits errors. Invariants:
- remote code is never run (`trust_remote_code=False`).
- `apply_chat_template` renders the template to text and tokenizes it WITHOUT adding special
  tokens, so a template that writes BOS itself yields exactly one BOS (case C12); its length is
  what transformers' `apply_chat_template(tokenize=True)` gives (case C11).
- `decode` never applies `clean_up_tokenization_spaces`, so the incremental detokenizer (which
  decodes windows of tokens) and a whole-sequence decode agree. With a fast tokenizer it calls
  the Rust backend (`backend_tokenizer.decode`) directly: that is what transformers' decode
  does without the clean-up, less its Python wrapper (0.8 against 2.7 us per call on the demo
  tokenizer; the detokenizer decodes twice per streamed token).

`IncrementalDetokenizer` turns one sequence's token ids to text, step by step, with stop
strings. Decoding uses the prefix/read-offset method (as in Hugging Face text-generation-inference):
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

import functools
import os
import re
from collections.abc import Sequence
from typing import Any

from sits.core.errors import InvalidParameterError, ModelNotFoundError
from sits.core.sampling_params import SamplingParams


class Tokenizer:
    """A transformers tokenizer with sits errors and engine-friendly methods.

    Args:
        source: a local directory holding tokenizer files (tokenizer.json,
            tokenizer_config.json, ...), or an already loaded transformers tokenizer.

    Raises:
        ModelNotFoundError: the directory does not exist or holds no loadable tokenizer.
    """

    def __init__(self, source: str | os.PathLike[str] | Any) -> None:
        if isinstance(source, str | os.PathLike):
            source = _load_hf_tokenizer(os.fspath(source))
        self._hf = source
        self._backend = _rust_backend(source)
        self._token_text_cache: dict[int, str] = {}
        self._token_bytes_cache: dict[int, bytes] = {}
        self._max_token_chars: int | None = None

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer (for code that needs the library directly)."""
        return self._hf

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id, or None."""
        return self._hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's BOS id, or None."""
        return self._hf.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        """The tokenizer's padding id, or None."""
        return self._hf.pad_token_id

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of all special tokens (BOS, EOS, PAD, extra special tokens)."""
        return list(self._hf.all_special_ids)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (`len(tokenizer)`).

        The model's logits may be wider (padded embeddings); ids beyond this decode to "".
        """
        return len(self._hf)

    @property
    def max_token_chars(self) -> int:
        """Length in characters of the longest vocabulary string (added tokens included),
        computed once. A token never decodes to more characters than its vocabulary string
        has (a byte-level BPE string holds one character per byte), so a text of C
        characters takes at least C / max_token_chars tokens: a prompt can be refused as too
        long before it is tokenized (`sits.server.params.check_text_fits`)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._hf.get_vocab()), default=1) or 1
        return self._max_token_chars

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer carries a chat template."""
        return bool(getattr(self._hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens` the post-processor adds BOS etc.

        transformers' warning for a text longer than the model is off (verbose=False): the
        engine and the server check the length themselves and refuse such a prompt with a
        clear error, so the warning only repeated it in the log."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens, verbose=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (no clean-up of spaces; invalid UTF-8 becomes U+FFFD)."""
        if self._backend is not None:
            return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Vocabulary strings of `token_ids` (byte-level tokens look like "Ġthe")."""
        return list(self._hf.convert_ids_to_tokens(list(token_ids)))

    def decode_token(self, token_id: int) -> str:
        """Text of one token alone, as shown in logprob entries (cached).

        A token holding part of a multi-byte character decodes to U+FFFD; special tokens keep
        their text.
        """
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token adds to a text (cached): its text alone when that is
        whole characters, else the bytes behind its vocabulary string (a byte-level BPE
        string maps one character to one byte; a byte-fallback piece "<0xNN>" is byte NN), so
        a character split over several tokens keeps its own bytes instead of U+FFFD.

        Special tokens give the bytes of their text.
        """
        raw = self._token_bytes_cache.get(token_id)
        if raw is None:
            text = self.decode_token(token_id)
            raw = text.encode("utf-8")
            if _REPLACEMENT_CHAR in text:
                piece = self._hf.convert_ids_to_tokens(token_id)
                raw = _piece_bytes(piece) if isinstance(piece, str) else None
                raw = text.encode("utf-8") if raw is None else raw
            self._token_bytes_cache[token_id] = raw
        return raw

    def use_chat_template(self, template: str) -> None:
        """Render chats with `template` (a Jinja chat template, vLLM's `--chat-template`)
        instead of the tokenizer's own.

        Raises:
            InvalidParameterError("chat_template"): the template is not valid Jinja.
        """
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            ImmutableSandboxedEnvironment().parse(template)
        except TemplateSyntaxError as exc:
            raise InvalidParameterError(
                "chat_template", f"the chat template is not valid Jinja: {exc}"
            ) from exc
        self._hf.chat_template = template

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render `messages` with the tokenizer's chat template to text.

        Args:
            messages: OpenAI-style messages ({"role": ..., "content": ...}), at least one.
            add_generation_prompt: append the template's assistant header.
            tools: tool definitions passed to the template.
            chat_template_kwargs: extra template variables (e.g. enable_thinking).

        Raises:
            InvalidParameterError("messages"): no messages, no chat template, or the template
                rejected the messages (a jinja error or the template's raise_exception()).
        """
        from jinja2 import TemplateError

        if not messages:
            raise InvalidParameterError("messages", "messages must be a non-empty list.")
        if not self.has_chat_template:
            raise InvalidParameterError(
                "messages",
                "this model's tokenizer has no chat template; use the completions API instead.",
            )
        try:
            text = self._hf.apply_chat_template(
                list(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            raise InvalidParameterError(
                "messages", f"the chat template rejected the messages: {exc}"
            ) from exc
        assert isinstance(text, str)
        return text

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat (the template's own BOS only: never a second one).

        Raises:
            InvalidParameterError("messages"): as `render_chat`.
        """
        text = self.render_chat(messages, add_generation_prompt, tools, chat_template_kwargs)
        return self.encode(text, add_special_tokens=False)


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


def _load_hf_tokenizer(path: str) -> Any:
    """Load a transformers tokenizer from a local directory without remote code."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ModelNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"no loadable tokenizer in {path!r}: {exc}") from exc


_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's character -> byte table (GPT-2's printable stand-ins for 256 bytes)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _piece_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary string stands for: a byte-fallback piece "<0xNN>" or a
    byte-level BPE string; None when it is neither."""
    match = _BYTE_FALLBACK_PIECE.fullmatch(piece)
    if match is not None:
        return bytes([int(match.group(1), 16)])
    table = _byte_level_table()
    if piece and all(char in table for char in piece):
        return bytes(table[char] for char in piece)
    return None


def _rust_backend(hf_tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast transformers tokenizer, else None."""
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:
        return None
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, RustTokenizer) else None
