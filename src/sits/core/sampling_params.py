"""`SamplingParams`: how one request's tokens are chosen and when it stops.

Names, defaults and meanings follow vLLM's `SamplingParams` (and through it the OpenAI API) so
users can switch without relearning. Validation happens at construction: an invalid value raises
`InvalidParameterError` (a `ValueError`) naming the parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from sits.core.errors import InvalidParameterError
from sits.core.structured_outputs import StructuredOutputsParams

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 128  # OpenAI's limit on samples per request
# Stop conditions are checked on every generated token, so their number and length bound the
# per-token cost of a request. OpenAI allows 4 stop strings; vLLM sets no limit, so a limit
# well above what stop lists hold in practice keeps its users' requests working.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class RequestOutputKind(Enum):
    """What each `RequestOutput` of a streaming request carries."""

    CUMULATIVE = 0  # all text and tokens so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM names and defaults).

    Attributes:
        n: number of samples returned for the prompt (1..128); samples share the prompt's KV
            blocks.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens whose probability is below min_p times the top probability.
        seed: seed of the request's own random generator (same tokens alone or batched).
        presence_penalty, frequency_penalty: OpenAI penalties on generated tokens, in [-2, 2].
        repetition_penalty: CTRL-style penalty (Keskar et al. 2019) on prompt and output tokens;
            1 disables.
        stop: strings that end generation; the match is excluded from the text unless
            `include_stop_str_in_output`.
        stop_token_ids: token ids that end generation (kept in `token_ids`).
        ignore_eos: keep generating after the EOS token.
        max_tokens: most tokens to generate; None means up to the context length.
        min_tokens: EOS and stop_token_ids are masked until this many tokens exist.
        logprobs: number of top alternatives returned per generated token (the chosen token's
            logprob is always included); None returns none.
        prompt_logprobs: likewise for prompt tokens.
        skip_special_tokens: drop special tokens from the output text.
        output_kind: cumulative, delta or final-only outputs while streaming.
        structured_outputs: the constraint the output must match (JSON schema, regex, choice,
            grammar: `sits.core.structured_outputs`), or None. min_tokens does not hold a
            constrained request's EOS back: the grammar decides where the output ends.

    Raises:
        InvalidParameterError: a value is out of range; `param` names it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, list | tuple):
                raise InvalidParameterError(name, f"{name} must be a list, got {value!r}.")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidParameterError:
            return InvalidParameterError(param, f"{param} {why}")

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}.")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}.")
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise bad(
                "top_k", f"must be an integer, -1 or 0 (disabled) or >= 1, got {self.top_k!r}."
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}.")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"must be an integer, got {self.seed!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value!r}.")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"must be a finite number > 0, got {self.repetition_penalty!r}.",
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise bad("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(
                "min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {MAX_LOGPROBS}], got {value!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"holds {len(self.stop)} strings; at most {MAX_STOP_STRINGS}.")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters.")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(
                "stop_token_ids",
                f"holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}.",
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "must be a StructuredOutputsParams.")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax (temperature 0)."""
        return self.temperature < _GREEDY_EPS


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (NaN and infinities are refused), not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
