"""OpenAI `/v1/completions` request and response types (with vLLM's sampling extras).

Defaults follow the OpenAI API reference (`max_tokens` 16, `temperature` 1, `top_p` 1, `n` 1);
the vLLM extras (`top_k`, `min_p`, `ignore_eos`, ...) keep vLLM's names and defaults. Value
ranges are checked when the request becomes a `SamplingParams` (one place, naming the field).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from sits.server.protocol import GuidedFields, StreamOptions, UsageInfo

# A prompt: text, a batch of texts, token ids, or a batch of token-id lists.
PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(GuidedFields):
    """Body of `POST /v1/completions`.

    The structured-output fields (`response_format`, vLLM's `guided_*`, `structured_outputs`)
    come from `protocol.GuidedFields`. Fields that would change the meaning of the request but
    are not supported (`suffix`,
    `best_of` above `n`, a non-empty `logit_bias`) are accepted by the parser and refused with
    a 400 naming them (see `sits.server.params`), never ignored.
    """

    model: str | None = None
    prompt: PromptInput
    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = 0
    cache_salt: str | None = None


class CompletionLogprobs(BaseModel):
    """Legacy OpenAI completion logprobs: one entry per returned token, aligned lists.

    Attributes:
        text_offset: character offset of each token in the choice's text (after the prompt's
            text when not echoed).
        token_logprobs: the chosen token's logprob (None for the first prompt token).
        tokens: each token's text.
        top_logprobs: per token, token text -> logprob of the chosen token and the top N.
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice of a completion; `stop_reason` (vLLM) is the stop string or token id."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    """Body of a non-streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionStreamChoice(BaseModel):
    """One choice's delta inside a streamed completion chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(BaseModel):
    """One `data:` event of a streamed completion; `usage` is null except in the usage chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None
