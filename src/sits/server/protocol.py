"""OpenAI wire types shared by every endpoint: errors, usage, stream options, models, tokenize.

Field names and shapes follow the OpenAI API reference and vLLM's extensions (`/tokenize`,
`/detokenize`, `max_model_len` on a model card) so the official `openai` client and vLLM users
read them unchanged. Request models forbid unknown fields (OpenAI answers 400 "Unrecognized
request argument"); the error handler names the field in `param`.
"""

from __future__ import annotations

import time
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are a 400, never silently ignored, and no
    value is coerced (strict: "5" is no integer and "yes" no boolean, as in OpenAI's API; an
    integer is still a valid float). A null for a field that cannot be null (e.g. "n")
    means its default, as OpenAI's API reads it; where null is a value (a completion's
    "max_tokens": null fills the context) it stays."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            name: value
            for name, value in data.items()
            if value is not None
            or name not in fields
            or fields[name].is_required()
            or _allows_none(fields[name].annotation)
        }


def _allows_none(annotation: Any) -> bool:
    """Whether a field's type takes None (`X | None`, Optional[X], Any)."""
    return annotation is Any or annotation is None or type(None) in get_args(annotation)


class ErrorInfo(BaseModel):
    """The `error` object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    """Details of the prompt's tokens (how many came from the prefix cache)."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one request.

    Attributes:
        prompt_tokens: prompt tokens, counted once per prompt however many samples (n) run.
        completion_tokens: generated tokens summed over every choice.
        total_tokens: prompt_tokens + completion_tokens.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema` (OpenAI): the schema is always enforced (`strict` or not:
    constrained decoding cannot follow a schema loosely)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: "text", "json_object" (any JSON object) or "json_schema"."""

    model_config = ConfigDict(extra="forbid")

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(RequestModel):
    """vLLM's `structured_outputs` object: one of json, json_object, regex, choice, grammar,
    structural_tag (`sits.core.structured_outputs.StructuredOutputsParams`)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class GuidedFields(RequestModel):
    """The structured-output fields of chat and completion requests (their base):
    OpenAI's `response_format` and vLLM's `guided_*` and `structured_outputs` extras."""

    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputsBody | None = None


class StreamOptions(RequestModel):
    """`stream_options`: usage chunk at the end (OpenAI) and in every chunk (vLLM extra)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ModelCard(BaseModel):
    """One entry of `GET /v1/models`.

    Attributes:
        id: the served model name (what clients pass as `model`).
        root: the checkpoint directory.
        max_model_len: context length in tokens (vLLM extra).
        random_weights: True when the weights are random (the untrained demo model): its text
            is noise; the field exists so nobody mistakes it for a trained model.
        description: a plain sentence saying what is served.
    """

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sits"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    random_weights: bool = False
    description: str | None = None
    permission: list[Any] = Field(default_factory=list)


class ModelList(BaseModel):
    """Body of `GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
