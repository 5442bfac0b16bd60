"""vLLM's `/tokenize` and `/detokenize` request and response types.

`/tokenize` takes either a text prompt (special tokens added by default) or chat messages
(rendered through the chat template; no special tokens added, so one BOS only).
"""

from __future__ import annotations

from pydantic import BaseModel

from sits.server.protocol import RequestModel
from sits.server.protocol_chat import ChatMessage


class TokenizeCompletionRequest(RequestModel):
    """`POST /tokenize` with a text prompt (vLLM shape)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestModel):
    """`POST /tokenize` with chat messages rendered through the chat template (vLLM shape)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    """Body of `POST /tokenize`: token ids, their count and the context limit."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    """`POST /detokenize`: token ids to text."""

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    """Body of `POST /detokenize`."""

    prompt: str
