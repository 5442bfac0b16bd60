"""From OpenAI request bodies to `SamplingParams`, and the refusal of unsupported fields.

Invariants:
- A field that would change the meaning of a request but is not implemented (tools,
  `suffix`, `best_of` > n, ...) is refused with a 400 naming it; it is never ignored silently.
- Structured outputs (`response_format`, vLLM's `guided_*` and `structured_outputs`) become the
  params' `structured_outputs`, checked by `sits.server.structured` (a 400 naming the field).
- Values are validated by `SamplingParams` itself (one place); fields whose OpenAI name differs
  from the `SamplingParams` name (`top_logprobs`, `max_completion_tokens`) are checked here so
  the error names the field the client sent.
- `max_tokens` / `max_completion_tokens` below 1 are refused (vLLM's rule), except
  `max_tokens: 0` on a completion with `echo` (the prompt's logprobs alone, case C03).
- A prompt that cannot fit is refused vLLM-style before it reaches the engine, by
  `sits.core.limits.resolve_limits` (the one place for a request's limits): prompt tokens +
  max_tokens > max_model_len is a 400 stating both numbers; with no max_tokens the completion
  may fill the context (at most `default_max_tokens_cap`), and a prompt that leaves no room at
  all is a 400 too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from sits.server.errors import ServerError, unsupported
from sits.server.protocol_chat import ChatCompletionRequest
from sits.server.protocol_completion import CompletionRequest
from sits.server.structured import structured_outputs_of
from sits.tenancy import TenantConfig

_MIN_SEED = -(2**63)
_MAX_SEED = 2**63 - 1


def _check_seed(seed: int | None) -> None:
    """OpenAI seeds are 64-bit integers; a larger one must not reach the engine's generator."""
    if seed is not None and not _MIN_SEED <= seed <= _MAX_SEED:
        raise InvalidParameterError("seed", f"seed must be a 64-bit signed integer, got {seed}.")


MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]


def _check_temperature(temperature: float | None) -> None:
    """Refuse a temperature above OpenAI's 2 (below 0 `SamplingParams` refuses)."""
    if temperature is not None and temperature > MAX_TEMPERATURE:
        raise InvalidParameterError(
            "temperature",
            f"temperature must be at most {MAX_TEMPERATURE:g}, got {temperature!r}.",
        )


def _check_stream_options(stream: bool | None, has_options: bool) -> None:
    if has_options and not stream:
        raise ServerError(
            400, "stream_options can only be set when stream is true.", param="stream_options"
        )


def check_completion_request(req: CompletionRequest) -> None:
    """Refuse the completion fields sits does not implement.

    Raises:
        ServerError: 400 naming the field.
    """
    if req.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported.")
    if req.best_of is not None and req.best_of != req.n:
        if req.best_of < req.n:
            raise ServerError(400, "best_of must be >= n.", param="best_of")
        raise unsupported("best_of", "best_of > n is not supported; use n.")
    if req.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported.")
    check_max_tokens("max_tokens", req.max_tokens, allow_zero=bool(req.echo))
    _check_seed(req.seed)
    _check_temperature(req.temperature)
    _check_stream_options(req.stream, req.stream_options is not None)


def _is_off(value: object) -> bool:
    return value is None or value == "none"


def check_chat_request(req: ChatCompletionRequest) -> None:
    """Refuse the chat fields sits does not implement.

    Raises:
        ServerError: 400 naming the field.
    """
    refused: list[tuple[str, bool, str]] = [
        ("tools", bool(req.tools), "tool calling is not supported."),
        ("tool_choice", not _is_off(req.tool_choice), "tool calling is not supported."),
        ("functions", bool(req.functions), "function calling is not supported."),
        ("function_call", not _is_off(req.function_call), "function calling is not supported."),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported."),
        (
            "modalities",
            req.modalities is not None and list(req.modalities) != ["text"],
            "only the text modality is supported.",
        ),
        ("audio", req.audio is not None, "audio output is not supported."),
        ("prediction", req.prediction is not None, "predicted outputs are not supported."),
        ("reasoning_effort", req.reasoning_effort is not None, "this model does not reason."),
        ("web_search_options", req.web_search_options is not None, "web search is unsupported."),
        ("continue_final_message", req.continue_final_message, "not supported."),
        ("echo", req.echo, "echo is not supported for chat completions."),
        ("chat_template", req.chat_template is not None, "custom chat templates unsupported."),
        ("chat_template_kwargs", bool(req.chat_template_kwargs), "not supported."),
        ("documents", bool(req.documents), "documents are not supported."),
        (
            "add_special_tokens",
            req.add_special_tokens,
            "the chat template writes the special tokens itself.",
        ),
    ]
    for param, bad, why in refused:
        if bad:
            raise unsupported(param, f"{param}: {why}")
    if req.top_logprobs is not None:
        if not isinstance(req.top_logprobs, int) or not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(
                "top_logprobs",
                f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                f"got {req.top_logprobs!r}.",
            )
        if req.top_logprobs > 0 and not req.logprobs:
            raise InvalidParameterError(
                "top_logprobs", "top_logprobs requires logprobs to be true."
            )
    check_max_tokens("max_completion_tokens", req.max_completion_tokens)
    check_max_tokens("max_tokens", req.max_tokens)
    _check_seed(req.seed)
    _check_temperature(req.temperature)
    _check_stream_options(req.stream, req.stream_options is not None)


def check_max_tokens(param: str, value: int | None, *, allow_zero: bool = False) -> None:
    """Refuse a token limit below 1, as vLLM does (0 only with `allow_zero`: a completion that
    echoes its prompt, case C03).

    Raises:
        InvalidParameterError: naming `param`, unless value is None or an integer >= 1 (>= 0).
    """
    if value is None:
        return
    lowest = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise InvalidParameterError(
            param, f"{param} must be an integer >= {lowest}, got {value!r}."
        )


def check_text_fits(param: str, num_chars: int, tokenizer: Any, max_model_len: int) -> None:
    """Refuse a text too long for the context before tokenizing it.

    A text of `num_chars` characters takes at least num_chars / `tokenizer.max_token_chars`
    tokens (`sits.engine.tokenizer.Tokenizer.max_token_chars`); when even that exceeds
    `max_model_len` the request is refused at once instead of holding the one tokenizer
    thread (and every request queued behind it) for seconds: 45 s for a 40 MB prompt on our
    CPU. A tokenizer without `max_token_chars` skips the check.

    Raises:
        PromptTooLongError: naming `param`.
    """
    max_token_chars = getattr(tokenizer, "max_token_chars", None)
    if not max_token_chars or num_chars <= max_model_len * max_token_chars:
        return
    at_least = -(-num_chars // max_token_chars)
    raise PromptTooLongError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"{param} has {num_chars} characters, at least {at_least} tokens. Please reduce the "
        f"length of the {param}.",
        param=param,
    )


def default_max_tokens_cap(
    tenant: TenantConfig | None, num_sequences: int, num_prompt_tokens: int = 0
) -> int | None:
    """The most tokens an unset max_tokens may stand for under a tenant's limits: its
    `max_tokens_per_request` (which bounds max_tokens x n over all prompts) and its
    `tokens_per_minute` less the request's `num_prompt_tokens` (admission reserves prompt +
    max_tokens x n from that bucket), shared by the request's `num_sequences` (prompts x n);
    at least 1 (the admission check then refuses what cannot fit); None when the tenant has
    neither limit (or there is no tenant).

    Without it, a chat request that leaves max_tokens out would ask for the rest of the
    context and be refused with 400 by any such tenant; OpenAI's clients leave it out."""
    if tenant is None:
        return None
    num_sequences = max(num_sequences, 1)
    caps = []
    if tenant.max_tokens_per_request is not None:
        caps.append(tenant.max_tokens_per_request // num_sequences)
    if tenant.tokens_per_minute is not None:
        caps.append((tenant.tokens_per_minute - num_prompt_tokens) // num_sequences)
    return max(min(caps), 1) if caps else None


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# Sampling fields a request may leave unset, with the value they then take when the
# model's generation_config.json (`ServerSettings.sampling_defaults`) gives none.
_UNSET_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _common_kwargs(
    req: CompletionRequest | ChatCompletionRequest, defaults: Mapping[str, float]
) -> dict[str, object]:
    unset = {
        name: value if (value := getattr(req, name)) is not None else defaults.get(name, base)
        for name, base in _UNSET_DEFAULTS.items()
    }
    return {
        "n": req.n,
        **unset,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "stop": _stop_list(req.stop),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "output_kind": RequestOutputKind.DELTA,
        "structured_outputs": structured_outputs_of(req),
    }


def completion_sampling_params(
    req: CompletionRequest, max_tokens: int | None, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """SamplingParams of a completion request (DELTA outputs; the server joins them).

    `echo` with `logprobs` asks for prompt logprobs too (the echoed prompt tokens carry theirs).
    Sampling fields the request leaves unset take `defaults` (the model's generation config,
    `ServerSettings.sampling_defaults`), else OpenAI's.

    Raises:
        InvalidParameterError: a value is out of range (`param` names the field).
    """
    prompt_logprobs = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    return SamplingParams(
        **_common_kwargs(req, defaults or {}),
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def chat_sampling_params(
    req: ChatCompletionRequest, max_tokens: int | None, defaults: Mapping[str, float] | None = None
) -> SamplingParams:
    """SamplingParams of a chat request: `logprobs` + `top_logprobs` become `logprobs=N`;
    unset sampling fields take `defaults` as in `completion_sampling_params`.

    Raises:
        InvalidParameterError: a value is out of range (`param` names the field).
    """
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return SamplingParams(
        **_common_kwargs(req, defaults or {}), max_tokens=max_tokens, logprobs=logprobs
    )


def generation_max_tokens(
    requested: int | None, default_cap: int | None, defaults: Mapping[str, float]
) -> tuple[int | None, int | None]:
    """`(requested, default_cap)` under the generation config's max_tokens (max_new_tokens),
    which bounds every request's output as vLLM reads it: an explicit max_tokens above it is
    lowered to it, and an unset one stands for at most it."""
    limit = defaults.get("max_tokens")
    if limit is None:
        return requested, default_cap
    limit = int(limit)
    capped = None if requested is None else min(requested, limit)
    return capped, limit if default_cap is None else min(default_cap, limit)


def check_max_logprobs(fields: Mapping[str, int | None], max_logprobs: int) -> None:
    """Refuse logprob counts above the server's `--max-logprobs`.

    Args:
        fields: the request's logprob fields by name (logprobs, top_logprobs,
            prompt_logprobs), None when unset.
        max_logprobs: `ServerSettings.max_logprobs`.

    Raises:
        InvalidParameterError: naming the first field above the limit.
    """
    for name, value in fields.items():
        if isinstance(value, int) and not isinstance(value, bool) and value > max_logprobs:
            raise InvalidParameterError(
                name, f"{name} must be at most {max_logprobs} (--max-logprobs), got {value}."
            )


def chat_max_tokens_field(req: ChatCompletionRequest) -> tuple[str, int | None]:
    """The (field name, value) limiting a chat answer: max_completion_tokens wins."""
    if req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens
