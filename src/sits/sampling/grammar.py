"""Structured outputs' grammars: check a `StructuredOutputsParams`, compile it with xgrammar for
the model's tokenizer, and cache the compiled grammars by the spec's key, off the step loop.

Two stages, as xgrammar splits them:
- `check_structured_outputs` builds the tokenizer-free `xgrammar.Grammar` (JSON schema -> EBNF,
  regex -> EBNF, EBNF parse, structural tag parse): it finds every invalid schema, regex or
  grammar in about a millisecond, so the server calls it before a request enters the engine
  and answers 400 naming the field.
- `GrammarCache.submit` compiles the grammar against the tokenizer (the token mask tables) in
  a small thread pool (xgrammar's compiler releases the GIL while it works), so a compile
  never blocks the step loop; compiled grammars are kept by `StructuredOutputsParams.key`
  (least recently used first out), so a repeated schema compiles once.

Whitespace: between JSON tokens a run of at most `MAX_JSON_WHITESPACE` whitespace characters
is allowed (vLLM sets no bound: a weak model can then write whitespace until max_tokens, which
ours did in tests; 32 still holds a pretty-printed line 7 levels deep), none with
`disable_any_whitespace` (xgrammar's compact separators then).

Kinds: `json` is compiled in xgrammar's strict mode (no property the schema does not list);
`json_object` is the schema `{"type": "object"}` without strict mode: any JSON object (the
builtin JSON grammar would also let a top-level array through); `choice` is the EBNF
alternation of its strings. The vocabulary is the model's logits width (the lm_head may have
more rows than the tokenizer has tokens: those ids are never allowed) and the stop tokens are
the model's EOS ids: the grammar allows one only where the output may end.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from sits.core.errors import InvalidParameterError
from sits.core.structured_outputs import StructuredOutputsParams

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and "Check failed: ...":
# the user reads only the reason.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")
MAX_CACHED_GRAMMARS = 256
MAX_JSON_WHITESPACE = 32  # whitespace characters between two JSON tokens (module docstring)
_OBJECT_SCHEMA = '{"type": "object"}'


def error_text(exc: BaseException) -> str:
    """xgrammar's error message without its log prefix (file, line, failed check)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    first = lines[0] if lines else type(exc).__name__
    return _LOG_PREFIX.sub("", first).strip()


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (each a JSON-escaped literal)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_structured_outputs(spec: StructuredOutputsParams, param: str) -> None:
    """Refuse an invalid schema, regex, grammar or structural tag (no tokenizer needed).

    Args:
        spec: the constraint.
        param: the request field it came from, named in the error (e.g.
            "response_format.json_schema.schema", "guided_regex").

    Raises:
        InvalidParameterError: naming `param`, with xgrammar's reason.
    """
    kind = spec.kind
    try:
        if kind == "json":
            schema = json.loads(spec.json)
            if not isinstance(schema, dict | bool):
                raise InvalidParameterError(param, "a JSON schema must be an object or a bool.")
            xgr.Grammar.from_json_schema(spec.json, **_json_options(spec))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec.regex)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec.grammar)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(spec.structural_tag)
    except InvalidParameterError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's and json's errors
        raise InvalidParameterError(param, f"invalid {kind}: {error_text(exc)}") from exc


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> Any:
    """The `xgrammar.CompiledGrammar` of `spec` (blocking; run it in `GrammarCache`'s pool).

    Raises:
        InvalidParameterError: the spec does not compile ("structured_outputs").
    """
    kind = spec.kind
    try:
        if kind == "json":
            return compiler.compile_json_schema(spec.json, **_json_options(spec))
        if kind == "json_object":
            return compiler.compile_json_schema(
                _OBJECT_SCHEMA, strict_mode=False, **_json_options(spec)
            )
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "grammar":
            return compiler.compile_grammar(spec.grammar)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(spec.choice))
        return compiler.compile_structural_tag(spec.structural_tag)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidParameterError(
            "structured_outputs", f"invalid {kind}: {error_text(exc)}"
        ) from exc


def _json_options(spec: StructuredOutputsParams) -> dict[str, Any]:
    """xgrammar's whitespace options of a JSON kind (module docstring)."""
    if spec.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


class GrammarCache:
    """Compiled grammars of one tokenizer, by spec key, compiled in a thread pool.

    Args:
        hf_tokenizer: the model's transformers tokenizer.
        vocab_size: the model's logits width (>= the tokenizer's length).
        stop_token_ids: the ids that end an output (the model's EOS ids).
        max_workers: compile threads.
        max_cached: compiled grammars kept (least recently used dropped first).

    Attributes:
        tokenizer_info: the xgrammar tokenizer info (vocabulary of `vocab_size` ids).
        vocab_size: V, the width of the masks.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_workers: int = 2,
        max_cached: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        # xgrammar's own cache is off: this one keys by the spec and bounds the count.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_workers, cache_enabled=False
        )
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="sits-grammar")
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._max_cached = max_cached

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The future of `spec`'s compiled grammar: the cached one, else a new compile.

        A compile that failed is not kept (the next request compiles again and fails alike).
        """
        key = spec.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            future = self._pool.submit(compile_spec, self._compiler, spec)
            self._futures[key] = future
            while len(self._futures) > self._max_cached:
                self._futures.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failed(key, f))
        return future

    def get(self, spec: StructuredOutputsParams) -> Any:
        """`spec`'s compiled grammar, waiting for its compile.

        Raises:
            InvalidParameterError: it does not compile.
        """
        return self.submit(spec).result()

    @property
    def num_cached(self) -> int:
        """Grammars compiled or compiling, kept."""
        with self._lock:
            return len(self._futures)

    def shutdown(self) -> None:
        """Stop the compile threads (running compiles finish, queued ones are cancelled)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_failed(self, key: tuple, future: Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._futures.get(key) is future:
                    del self._futures[key]
