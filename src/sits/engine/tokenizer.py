"""`Tokenizer`: a thin wrapper over a transformers tokenizer loaded from a checkpoint directory.

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
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sits.core.errors import InvalidParameterError, ModelNotFoundError


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


def _load_hf_tokenizer(path: str) -> Any:
    """Load a transformers tokenizer from a local directory without remote code."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise ModelNotFoundError(f"tokenizer directory {path!r} does not exist")
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"no loadable tokenizer in {path!r}: {exc}") from exc


def _rust_backend(hf_tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast transformers tokenizer, else None."""
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:
        return None
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, RustTokenizer) else None
