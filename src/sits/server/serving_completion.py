"""`POST /v1/completions`: prompts in, choices out (streamed or whole).

Invariants:
- a batch of prompts gives `len(prompts) * n` choices; prompt p's sample i is choice
  `p * n + i`; usage counts each prompt once and sums the completion tokens of every choice;
- `echo` puts the prompt's text before each choice's text and, with `logprobs`, the prompt's
  tokens (the first with a null logprob) before the generated ones;
- streamed: every chunk's `usage` is null, except one last chunk with no choices when
  `stream_options.include_usage` is set; then `data: [DONE]`. The joined text of a choice's
  chunks equals the non-streamed text (the engine holds back possible stop-string prefixes).
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
from sits.core.outputs import Logprob
from sits.core.sampling_params import SamplingParams
from sits.server.context import ServerContext
from sits.server.jobs import DONE_EVENT, EnginePrompt, GenerationJob, sse_event
from sits.server.logprobs import CompletionLogprobsBuilder, PositionLogprobs
from sits.server.params import (
    check_completion_request,
    check_max_logprobs,
    check_text_fits,
    completion_sampling_params,
    default_max_tokens_cap,
    generation_max_tokens,
)
from sits.server.protocol import UsageInfo
from sits.server.protocol_completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
)
from sits.server.serving_common import (
    Item,
    PromptResult,
    check_output,
    check_prompt_ids,
    encode_prompt,
    request_job,
    results_usage,
    serve_job,
    start_request,
    usage_of,
)
from sits.tenancy import TenantConfig


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a request: one text, one token list, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidParameterError("prompt", "prompt is empty: give at least one prompt.")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def build_prompts(
    req: CompletionRequest,
    ctx: ServerContext,
    base: SamplingParams,
    tenant: TenantConfig | None = None,
) -> list[EnginePrompt]:
    """Tokenize and check every prompt and give each its resolved max_tokens (a null one is
    capped by the tenant's `max_tokens_per_request` and `tokens_per_minute`,
    `default_max_tokens_cap`).

    Raises:
        InvalidParameterError: an empty prompt, or a token id of the prompt or of
            stop_token_ids outside the vocabulary.
        PromptTooLongError: prompt + max_tokens does not fit the context.
    """
    tokenizer = ctx.tokenizer
    check_prompt_ids(req.stop_token_ids or [], tokenizer, "stop_token_ids")
    encoded = []  # (text, token_ids) per prompt
    items = _split_prompts(req.prompt)
    for item in items:
        if isinstance(item, str):
            text: str | None = item
            check_text_fits("prompt", len(item), tokenizer, ctx.max_model_len)
            token_ids = encode_prompt(tokenizer, item, req.add_special_tokens)
        else:
            text, token_ids = None, list(item)
        check_prompt_ids(token_ids, tokenizer, "prompt")
        encoded.append((text, token_ids))
    num_prompt_tokens = sum(len(token_ids) for _, token_ids in encoded)
    cap = default_max_tokens_cap(tenant, len(items) * base.n, num_prompt_tokens)
    requested, cap = generation_max_tokens(req.max_tokens, cap, ctx.settings.sampling_defaults)
    prompts = []
    for text, token_ids in encoded:
        fill_cap = ctx.fill_cap(cap, len(token_ids))
        limits = resolve_limits(len(token_ids), requested, ctx.max_model_len, default_cap=fill_cap)
        params = dataclasses.replace(base, max_tokens=limits.max_tokens)
        prompts.append(EnginePrompt(text, token_ids, params))
    return prompts


class _CompletionRenderer:
    """Turns a job's outputs into completion chunks or one completion body."""

    def __init__(
        self, ctx: ServerContext, req: CompletionRequest, prompts: list[EnginePrompt], rid: str
    ) -> None:
        self.ctx = ctx
        self.req = req
        self.prompts = prompts
        self.request_id = rid
        self.created = int(time.time())
        self.n = req.n
        self.echo = bool(req.echo)
        self.with_details = ctx.settings.enable_prompt_tokens_details
        self._prompt_texts: dict[int, str] = {}

    def prompt_text(self, index: int) -> str:
        """The prompt's text: as given, or decoded from its token ids."""
        if index not in self._prompt_texts:
            prompt = self.prompts[index]
            self._prompt_texts[index] = (
                prompt.text
                if prompt.text is not None
                else self.ctx.tokenizer.decode(prompt.token_ids, self.req.skip_special_tokens)
            )
        return self._prompt_texts[index]

    def _builder(self, index: int) -> CompletionLogprobsBuilder | None:
        if self.req.logprobs is None:
            return None
        offset = 0 if self.echo else len(self.prompt_text(index))
        tokenizer = self.ctx.tokenizer
        skip = tokenizer.all_special_ids if self.req.skip_special_tokens else ()
        return CompletionLogprobsBuilder(tokenizer, self.req.logprobs, offset, skip)

    def _echo_logprobs(
        self,
        builder: CompletionLogprobsBuilder,
        index: int,
        prompt_logprobs: list[PositionLogprobs] | None,
        token_ids: list[int],
        entries: list[PositionLogprobs],
    ) -> CompletionLogprobs:
        """The echoed prompt's logprobs, then the generated tokens' from its text's length."""
        prompt = self.prompts[index]
        prompt_entries = self._prompt_entries(index, prompt_logprobs)
        return builder.build_echo(
            (prompt.token_ids, prompt_entries, len(self.prompt_text(index))), token_ids, entries
        )

    def _prompt_entries(
        self, index: int, prompt_logprobs: list[PositionLogprobs] | None
    ) -> list[PositionLogprobs]:
        num = len(self.prompts[index].token_ids)
        entries = list(prompt_logprobs or [])[:num]
        return entries + [None] * (num - len(entries))

    # --- whole answer ----------------------------------------------------------------------
    def final(self, results: list[PromptResult]) -> CompletionResponse:
        choices = []
        for p_index, result in enumerate(results):
            for s_index, sample in enumerate(result.samples):
                token_ids = list(sample.token_ids)
                entries: list[PositionLogprobs] = list(sample.logprobs or [])
                entries += [None] * (len(token_ids) - len(entries))
                text = sample.text
                builder = self._builder(p_index)
                logprobs = None
                if self.echo:
                    text = self.prompt_text(p_index) + text
                if builder is not None and self.echo:
                    logprobs = self._echo_logprobs(
                        builder, p_index, result.prompt_logprobs, token_ids, entries
                    )
                elif builder is not None:
                    logprobs = builder.build(token_ids, entries)
                choices.append(
                    CompletionChoice(
                        index=p_index * self.n + s_index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=sample.finish_reason,
                        stop_reason=sample.stop_reason,
                        prompt_logprobs=_wire_prompt_logprobs(result.prompt_logprobs)
                        if self.req.prompt_logprobs is not None
                        else None,
                    )
                )
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.ctx.model_name,
            choices=choices,
            usage=results_usage(results, self.with_details),
        )

    # --- stream ----------------------------------------------------------------------------
    async def stream(self, items: AsyncIterator[Item]) -> AsyncIterator[str]:
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)
        prompt_counts = [len(p.token_ids) for p in self.prompts]
        completion_counts = [0] * (len(self.prompts) * self.n)
        builders: dict[int, CompletionLogprobsBuilder | None] = {}
        prompt_logprobs: dict[int, list[PositionLogprobs]] = {}
        cached: dict[int, int] = {}

        def usage() -> UsageInfo:
            num_cached = sum(cached.values()) if self.with_details else None
            return usage_of(prompt_counts, completion_counts, num_cached)

        async for p_index, output in items:
            check_output(output)
            cached[p_index] = output.num_cached_tokens
            if output.prompt_logprobs is not None:
                prompt_logprobs[p_index] = list(output.prompt_logprobs)
            for delta in output.outputs:
                choice = p_index * self.n + delta.index
                text, token_ids = delta.text, list(delta.token_ids)
                entries: list[PositionLogprobs] = list(delta.logprobs or [])
                entries += [None] * (len(token_ids) - len(entries))
                first = choice not in builders
                if first:
                    builders[choice] = self._builder(p_index)
                builder = builders[choice]
                logprobs = None
                echo_now = first and self.echo
                if echo_now:
                    text = self.prompt_text(p_index) + text
                if builder is not None and echo_now:
                    logprobs = self._echo_logprobs(
                        builder, p_index, prompt_logprobs.get(p_index), token_ids, entries
                    )
                elif builder is not None:
                    logprobs = builder.build(token_ids, entries)
                completion_counts[choice] += len(delta.token_ids)
                # Every step that generated tokens makes a chunk, as in vLLM, even when their
                # text is held back or decodes to "": a client sees each token arrive.
                if not (text or delta.finish_reason or token_ids or echo_now):
                    continue
                chunk = CompletionStreamResponse(
                    id=self.request_id,
                    created=self.created,
                    model=self.ctx.model_name,
                    choices=[
                        CompletionStreamChoice(
                            index=choice,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=delta.finish_reason,
                            stop_reason=delta.stop_reason,
                        )
                    ],
                    usage=usage() if continuous else None,
                )
                yield sse_event(chunk)
        if include_usage:
            yield sse_event(
                CompletionStreamResponse(
                    id=self.request_id,
                    created=self.created,
                    model=self.ctx.model_name,
                    choices=[],
                    usage=usage(),
                )
            )
        yield DONE_EVENT


def _wire_prompt_logprobs(
    entries: list[dict[int, Logprob] | None] | None,
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per position, token id -> logprob, rank, text."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


async def create_completion(req: CompletionRequest, raw: Request, ctx: ServerContext) -> Response:
    """Serve one completion request (see the module docstring).

    Raises:
        ServerError, InvalidParameterError, PromptTooLongError: as OpenAI error bodies.
    """
    prompts: list[EnginePrompt] = []

    def prepare(tenant: TenantConfig) -> GenerationJob:
        ctx.check_model(req.model)
        check_completion_request(req)
        settings = ctx.settings
        logprob_fields = {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs}
        check_max_logprobs(logprob_fields, settings.max_logprobs)
        base = completion_sampling_params(req, req.max_tokens, settings.sampling_defaults)
        prompts.extend(build_prompts(req, ctx, base, tenant))
        return request_job(ctx, raw, req, "cmpl", prompts, tenant)

    ticket, qos, job = await start_request(ctx, raw, prepare)
    renderer = _CompletionRenderer(ctx, req, prompts, job.request_id)
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
