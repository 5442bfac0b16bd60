"""`POST /v1/chat/completions`: messages through the chat template, assistant answers out.

Invariants:
- the prompt is the tokenizer's chat template rendered with `add_generation_prompt` and
  tokenized without adding special tokens, so a template that writes BOS gives exactly one
  (case C12) and prompt_tokens equals transformers' `apply_chat_template` length (C11);
- content may be a string or a list of `{"type": "text"}` parts (joined with "\\n"); other
  part types, tool messages and tool calls are a 400 naming `messages`;
- streamed: each choice's first chunk carries `role: "assistant"`; every chunk's `usage` is
  null except one last chunk with no choices when `stream_options.include_usage` is set.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from sits.core.errors import InvalidParameterError
from sits.core.limits import resolve_limits
from sits.server.context import ServerContext
from sits.server.jobs import DONE_EVENT, EnginePrompt, GenerationJob, sse_event
from sits.server.logprobs import PositionLogprobs, chat_logprobs_content
from sits.server.params import (
    chat_max_tokens_field,
    chat_sampling_params,
    check_chat_request,
    check_max_logprobs,
    check_max_tokens,
    check_text_fits,
    default_max_tokens_cap,
    generation_max_tokens,
)
from sits.server.protocol import UsageInfo
from sits.server.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from sits.server.serving_common import (
    Item,
    PromptResult,
    check_output,
    check_prompt_ids,
    check_text,
    drop_double_bos,
    request_job,
    results_usage,
    serve_job,
    start_request,
    usage_of,
)
from sits.tenancy import TenantConfig

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content_text(index: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        raise InvalidParameterError(
            "messages", f"messages[{index}] has no content (tool calls are not supported)."
        )
    if isinstance(content, str):
        check_text("messages", content)
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidParameterError(
                "messages",
                f"messages[{index}]: content parts of type {part.type!r} are not supported; "
                "only text parts are.",
            )
        check_text("messages", part.text)
        texts.append(part.text)
    return "\n".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role and string content.

    Raises:
        InvalidParameterError("messages"): no messages, an unsupported role, content or field.
    """
    if not messages:
        raise InvalidParameterError("messages", "messages must contain at least one message.")
    out = []
    for index, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidParameterError(
                "messages",
                f"messages[{index}].role {message.role!r} is not supported; use system, user "
                "or assistant.",
            )
        extra = message.model_extra or {}
        for field in ("tool_calls", "function_call", "tool_call_id", "audio"):
            if extra.get(field):
                raise InvalidParameterError(
                    "messages", f"messages[{index}].{field} is not supported."
                )
        out.append({"role": role, "content": _content_text(index, message)})
    return out


def build_chat_prompt(
    req: ChatCompletionRequest, ctx: ServerContext, tenant: TenantConfig | None = None
) -> EnginePrompt:
    """Render, tokenize and check the chat prompt and resolve its max_tokens (an unset one
    is capped by the tenant's `max_tokens_per_request` and `tokens_per_minute`,
    `default_max_tokens_cap`).

    Raises:
        InvalidParameterError, PromptTooLongError: naming the field at fault.
    """
    field, requested = chat_max_tokens_field(req)
    check_max_tokens(field, requested)
    defaults = ctx.settings.sampling_defaults
    top = req.top_logprobs if req.logprobs else None
    check_max_logprobs({"top_logprobs": top}, ctx.settings.max_logprobs)
    base = chat_sampling_params(req, requested, defaults)
    tokenizer = ctx.tokenizer
    messages = template_messages(req.messages)
    num_chars = sum(len(m["content"]) for m in messages if isinstance(m["content"], str))
    check_text_fits("messages", num_chars, tokenizer, ctx.max_model_len)
    token_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=req.add_generation_prompt
    )
    token_ids = drop_double_bos(list(token_ids), tokenizer.bos_token_id)
    check_prompt_ids(token_ids, tokenizer, "messages")
    check_prompt_ids(req.stop_token_ids or [], tokenizer, "stop_token_ids")
    cap = default_max_tokens_cap(tenant, base.n, len(token_ids))
    requested, cap = generation_max_tokens(requested, cap, defaults)
    limits = resolve_limits(
        len(token_ids),
        requested,
        ctx.max_model_len,
        prompt_param="messages",
        default_cap=ctx.fill_cap(cap, len(token_ids)),
    )
    return EnginePrompt(None, token_ids, dataclasses.replace(base, max_tokens=limits.max_tokens))


class _ChatRenderer:
    """Turns a job's outputs into chat chunks or one chat body."""

    def __init__(
        self, ctx: ServerContext, req: ChatCompletionRequest, prompt: EnginePrompt, rid: str
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.prompt = prompt
        self.request_id = rid
        self.created = int(time.time())
        self.num_top = req.top_logprobs or 0
        self.with_details = ctx.settings.enable_prompt_tokens_details

    def _logprobs(
        self, token_ids: list[int], entries: list[PositionLogprobs] | None
    ) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        entries = list(entries or [])
        entries += [None] * (len(token_ids) - len(entries))
        content = chat_logprobs_content(token_ids, entries, self.num_top, self.ctx.tokenizer)
        return ChatLogprobs(content=content)

    def final(self, results: list[PromptResult]) -> ChatCompletionResponse:
        (result,) = results
        choices = [
            ChatChoice(
                index=index,
                message=ChatResponseMessage(content=sample.text),
                logprobs=self._logprobs(sample.token_ids, sample.logprobs),
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
            )
            for index, sample in enumerate(result.samples)
        ]
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=results_usage(results, self.with_details),
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse_event(
            ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.ctx.model_name,
                choices=choices,
                usage=usage,
            )
        )

    async def stream(self, items: AsyncIterator[Item]) -> AsyncIterator[str]:
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        prompt_counts = [len(self.prompt.token_ids)]
        completion_counts = [0] * self.req.n
        num_cached = 0

        def usage() -> UsageInfo:
            details = num_cached if self.with_details else None
            return usage_of(prompt_counts, completion_counts, details)

        role_sent = False
        async for _, output in items:
            check_output(output)
            num_cached = output.num_cached_tokens
            if not role_sent:
                role_sent = True
                for index in range(self.req.n):
                    role = DeltaMessage(role="assistant", content="")
                    role_usage = usage() if continuous else None
                    yield self._chunk([ChatStreamChoice(index=index, delta=role)], role_usage)
            for delta in output.outputs:
                completion_counts[delta.index] += len(delta.token_ids)
                # Every step that generated tokens makes a chunk, as in vLLM: tokens whose text
                # is held back (a partial character, a stop-string prefix) or decodes to ""
                # send `content: ""`, so a client sees each token arrive (TTFT, ITL).
                if not (delta.text or delta.finish_reason or delta.token_ids):
                    continue
                choice = ChatStreamChoice(
                    index=delta.index,
                    delta=(
                        DeltaMessage(content=delta.text)
                        if delta.text or delta.token_ids
                        else DeltaMessage()
                    ),
                    logprobs=self._logprobs(list(delta.token_ids), delta.logprobs),
                    finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason,
                )
                yield self._chunk([choice], usage() if continuous else None)
        if include_usage:
            yield self._chunk([], usage())
        yield DONE_EVENT


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, ctx: ServerContext
) -> Response:
    """Serve one chat completion request (see the module docstring).

    Raises:
        ServerError, InvalidParameterError, PromptTooLongError: as OpenAI error bodies.
    """
    prompts: list[EnginePrompt] = []

    def prepare(tenant: TenantConfig) -> GenerationJob:
        ctx.check_model(req.model)
        check_chat_request(req)
        prompts.append(build_chat_prompt(req, ctx, tenant))
        return request_job(ctx, raw, req, "chatcmpl", prompts, tenant)

    # A per-request limit's 400 names the chat's own fields.
    names = {"prompt": "messages", "max_tokens": chat_max_tokens_field(req)[0]}
    ticket, qos, job = await start_request(ctx, raw, prepare, names)
    renderer = _ChatRenderer(ctx, req, prompts[0], job.request_id)
    return await serve_job(
        ctx,
        raw,
        ticket,
        qos,
        job,
        stream=bool(req.stream),
        render_stream=renderer.stream,
        render_final=renderer.final,
    )
