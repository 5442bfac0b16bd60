"""What completions and chat share: prompt token checks, admission, running a job, joining
DELTA outputs.

`start_request` admits one generation request: the server lifecycle (drain, engine health),
then the handler's parsing and tokenizing (`prepare`, run on the context's one tokenizer
thread, so a huge prompt never stalls the event loop and the tokenizer is never used by two
encodes at once), then QoS (`ServerQos.admit`: breaker,
overload, rate limits) with the job's whole token reservation; any refusal on the way is
counted as the tenant's outcome and nothing stays held. A body refused before the handler
runs (invalid JSON, a field of the wrong type) is counted too, as a 400 of its tenant
(`count_invalid_body`, C16: the metrics count every answer a client got).
`serve_job` owns the life of one generation request once it is admitted:
1. it registers and starts the job (with an audit log, storing the job id in the request
   state, `AUDITED_STATE_KEY`: a refusal from here on shares the id of the job's records),
   then waits for the first output while watching for a disconnect, so engine-side refusals
   (prompt too long for the KV cache, ...) are still an HTTP 400 and not a broken stream;
2. streamed: it hands an `SSEResponse` the renderer's frames (an exception becomes a final
   error event) and the cleanup; non-streamed: it joins all outputs while watching for a
   disconnect;
3. in every case it closes the job (aborting what is unfinished, freeing KV blocks at once),
   unregisters it, releases the lifecycle ticket and finishes the QoS ticket with the outcome
   (ok, client error, 503, engine error, abort) and the tokens really used.
Engine failures of a non-streamed request leave as `ServerError`s, so every answer passes the
QoS header middleware. With `--precision-switch`, a successful answer carries the weight set
in `x-sits-precision`: the first output's for a stream (the set when the response starts), the
last output's for a whole answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from sits.admission import retry_after_headers
from sits.core.errors import InvalidParameterError
from sits.core.outputs import CompletionOutput, Logprob, RequestOutput
from sits.obs.request_audit import AUDITED_STATE_KEY
from sits.server.context import ServerContext, Ticket
from sits.server.engine_client import ServerTokenizer
from sits.server.errors import ServerError, error_body, to_server_error
from sits.server.jobs import (
    DONE_EVENT,
    ClientDisconnected,
    EnginePrompt,
    GenerationJob,
    SSEResponse,
    run_until_disconnect,
    sse_event,
    was_dropped_unstarted,
)
from sits.server.precision import PRECISION_HEADER
from sits.server.protocol import PromptTokensDetails, UsageInfo
from sits.server.qos.admit import (
    TENANT_STATE_KEY,
    Outcome,
    QosTicket,
    outcome_of,
    request_tenant,
    require_tenant,
)
from sits.server.request_id import set_response_id
from sits.server.request_tracing import received_at
from sits.tenancy import TenantConfig

logger = logging.getLogger(__name__)

CLIENT_CLOSED_STATUS = 499  # nginx's "client closed request"; nobody reads it
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})

Item = tuple[int, RequestOutput]
StreamRenderer = Callable[[AsyncIterator[Item]], AsyncIterator[str]]
FinalRenderer = Callable[[list["PromptResult"]], BaseModel]

# A queued job past its start deadline is shed by the engine (it drops the job unstarted); this
# factor x the queue timeout bounds the wait for a first output in case that never comes.
QUEUE_BACKSTOP_FACTOR = 2.0


def drop_double_bos(token_ids: list[int], bos_token_id: int | None) -> list[int]:
    """Keep one BOS when a prompt starts with two (text that already held BOS, case C12)."""
    if bos_token_id is not None and token_ids[:2] == [bos_token_id, bos_token_id]:
        return token_ids[1:]
    return token_ids


def check_text(param: str, text: str) -> None:
    """Refuse text that is not valid Unicode (lone surrogates, which JSON can carry).

    Raises:
        InvalidParameterError: naming `param`.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidParameterError(
            param, f"{param} is not valid Unicode text (position {exc.start}: lone surrogate)."
        ) from exc


def encode_prompt(tokenizer: ServerTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of a text prompt with exactly one BOS when the tokenizer adds one.

    Raises:
        InvalidParameterError("prompt"): the text is not valid Unicode.
    """
    check_text("prompt", text)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return drop_double_bos(list(ids), tokenizer.bos_token_id)


def check_prompt_ids(token_ids: list[int], tokenizer: ServerTokenizer, param: str) -> None:
    """Refuse token ids outside the vocabulary (an empty prompt is refused with the other
    limits, `sits.core.limits.resolve_limits`).

    Raises:
        InvalidParameterError: naming `param`.
    """
    vocab_size = getattr(tokenizer, "vocab_size", None)
    for token_id in token_ids:
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise InvalidParameterError(
                param, f"token id {token_id} is out of the vocabulary [0, {vocab_size})."
            )


@dataclass(slots=True)
class PromptResult:
    """The joined answer to one prompt: its samples and prompt facts."""

    prompt_token_ids: list[int]
    samples: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0


def check_output(output: RequestOutput) -> None:
    """Raise a 500 when the engine failed a request (finish_reason "error")."""
    for sample in output.outputs:
        if sample.finish_reason == "error":
            raise ServerError(
                500, "The engine failed while serving this request.", type="internal_server_error"
            )


def join_output(results: list[PromptResult], index: int, output: RequestOutput) -> None:
    """Fold one DELTA output of prompt `index` into `results`."""
    check_output(output)
    result = results[index]
    if output.prompt_logprobs is not None:
        result.prompt_logprobs = list(output.prompt_logprobs)
    result.num_cached_tokens = output.num_cached_tokens
    for delta in output.outputs:
        result.samples[delta.index].add_delta(delta)


async def iterate(first: Item | None, job: GenerationJob) -> AsyncIterator[Item]:
    """All (prompt index, output) items of a job, starting with the already read `first`."""
    if first is None:
        return
    yield first
    while (item := await job.next()) is not None:
        yield item


async def collect(first: Item | None, job: GenerationJob) -> list[PromptResult]:
    """Join every output of a job into one result per prompt."""
    results = [
        PromptResult(list(p.token_ids), [CompletionOutput(index=i) for i in range(p.params.n)])
        for p in job.prompts
    ]
    async for index, output in iterate(first, job):
        join_output(results, index, output)
    return results


def usage_of(
    prompt_token_counts: list[int],
    completion_token_counts: list[int],
    cached_tokens: int | None = None,
) -> UsageInfo:
    """Usage: each prompt counted once, completion tokens summed over every choice, and
    `prompt_tokens_details.cached_tokens` (prefix-cache hits) when `cached_tokens` is given."""
    prompt_tokens = sum(prompt_token_counts)
    completion_tokens = sum(completion_token_counts)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=None
        if cached_tokens is None
        else PromptTokensDetails(cached_tokens=cached_tokens),
    )


def results_usage(results: list[PromptResult], with_details: bool = False) -> UsageInfo:
    """Usage of a joined answer (with the cached prompt tokens when `with_details`)."""
    return usage_of(
        [len(r.prompt_token_ids) for r in results],
        [len(s.token_ids) for r in results for s in r.samples],
        sum(r.num_cached_tokens for r in results) if with_details else None,
    )


def request_job(
    ctx: ServerContext,
    raw: Request,
    req: Any,
    prefix: str,
    prompts: list[EnginePrompt],
    tenant: TenantConfig,
) -> GenerationJob:
    """`ctx.new_job` for an OpenAI request `req` (chat or completion): its `priority` and
    `cache_salt`, and the HTTP receipt time of `raw` (`sits.server.request_tracing.received_at`)."""
    job = ctx.new_job(
        prefix,
        prompts,
        tenant,
        priority=req.priority,
        cache_salt=req.cache_salt,
        received_s=received_at(raw),
    )
    set_response_id(raw, job.request_id)  # the response's x-request-id unless the client's
    if ctx.settings.log_requests:
        _log_request(job.request_id, tenant.id, prompts, ctx.settings.max_log_len)
    return job


def _log_request(
    request_id: str, tenant_id: str, prompts: list[EnginePrompt], max_log_len: int | None
) -> None:
    """One INFO line per prompt of a generation request (`--enable-log-requests`): its id,
    tenant, prompt (text up to `max_log_len` characters, else its token count) and params."""
    for index, prompt in enumerate(prompts):
        text = prompt.text
        if text is not None and max_log_len is not None:
            text = text[:max_log_len]
        logger.info(
            "received request %s%s (tenant %s): %d prompt tokens, prompt %r, params %s",
            request_id,
            f" prompt {index}" if len(prompts) > 1 else "",
            tenant_id,
            len(prompt.token_ids),
            text,
            prompt.params,
        )


async def start_request(
    ctx: ServerContext,
    raw: Request,
    prepare: Callable[[TenantConfig], GenerationJob],
    param_names: Mapping[str, str] | None = None,
) -> tuple[Ticket, QosTicket, GenerationJob]:
    """Admit a generation request (see the module docstring).

    Args:
        ctx: the server context.
        raw: the HTTP request (its tenant was set by the auth dependency).
        prepare: checks and tokenizes the request and builds its job for the tenant; runs
            on `ctx.tokenize_executor` (with the caller's context variables).
        param_names: the request's names for "prompt" and "max_tokens" in a per-request
            limit's 400 (`ServerQos.admit`); None: those names.

    Raises:
        ServerError, SitsError: refusals (503, 429, 400, 404), counted per tenant.
    """
    tenant = request_tenant(raw)
    trace = ctx.trace_of(raw)
    job = None
    try:
        with trace.admission():
            ticket = ctx.lifecycle.admit()
            try:
                ctx.qos.precheck(tenant)  # a refusal that needs no tokens: before the tokenizer
                job = await ctx.run_tokenizer(prepare, tenant)
                prompt_tokens = sum(len(p.token_ids) for p in job.prompts)
                max_tokens = sum((p.params.max_tokens or 0) * p.params.n for p in job.prompts)
                qos = ctx.qos.admit(tenant, prompt_tokens, max_tokens, param_names)
            except BaseException:
                ticket.release()
                raise
    except Exception as exc:
        num_prompts = 1 if job is None else len(job.prompts)
        ctx.qos.metrics.count_outcome(tenant.id, outcome_of(exc).value, num_prompts)
        raise
    trace.watch(job)
    return ticket, qos, job


async def count_invalid_body(raw: Request, err: ServerError) -> ServerError:
    """Count a request whose body was refused before its handler ran; the error to answer.

    FastAPI parses the JSON before it runs the routes' dependencies, so invalid JSON reaches
    here with no tenant: the key is checked now (a missing or unknown key is the 401 it would
    have been with a valid body). A generation request then counts as a 400 of its tenant in
    `sits:tenant_requests_total`, as a refusal inside the handler does.

    Args:
        raw: the HTTP request.
        err: the 400 made for the refused body.

    Returns:
        `err`, or the 401 of a request without a tenant.
    """
    route = raw.scope.get("route")
    dependencies = getattr(route, "dependencies", None) or ()
    if not any(d.dependency is require_tenant for d in dependencies):
        return err  # not a tenant route (admin, dashboard)
    if getattr(raw.state, TENANT_STATE_KEY, None) is None:
        try:
            await require_tenant(raw)
        except ServerError as auth_error:
            return auth_error
    if getattr(route, "path", None) in GENERATION_ROUTES:
        ctx: ServerContext = raw.app.state.ctx
        ctx.qos.metrics.count_outcome(request_tenant(raw).id, Outcome.BAD_REQUEST.value)
        ctx.trace_of(raw).set_outcome(Outcome.BAD_REQUEST)
    return err


def error_frame(exc: BaseException) -> str:
    """The final SSE event of a stream that failed: an OpenAI error body."""
    return sse_event(error_body(to_server_error(exc)))


async def _guarded(frames: AsyncIterator[str], failures: list[BaseException]) -> AsyncIterator[str]:
    """Pass frames through; an exception (appended to `failures`) ends the stream with an
    error event and [DONE]."""
    try:
        async for frame in frames:
            yield frame
    except ClientDisconnected:
        return
    except Exception as exc:  # noqa: BLE001 - the client gets it as an error event
        failures.append(exc)
        yield error_frame(exc)
        yield DONE_EVENT


async def serve_job(
    ctx: ServerContext,
    raw: Request,
    ticket: Ticket,
    qos: QosTicket,
    job: GenerationJob,
    *,
    stream: bool,
    render_stream: StreamRenderer,
    render_final: FinalRenderer,
) -> Response:
    """Run an admitted job to an HTTP response (see the module docstring).

    Raises:
        ServerError: turned into an OpenAI error body by the app's handlers.
    """
    handed_off = False
    outcome = Outcome.ABORT
    trace = ctx.trace_of(raw)

    async def cleanup(final: Outcome) -> None:
        try:
            await job.close()
        finally:
            ctx.lifecycle.remove_job(job)
            ticket.release()
            qos.finish(final, job.used_tokens, len(job.prompts))
            trace.set_outcome(final)

    try:
        ctx.lifecycle.add_job(job)
        if qos.start_within_s is not None:
            job.start_deadline_s = time.monotonic() + qos.start_within_s
        job.start()
        if ctx.audit is not None:  # its engine requests have records: a refusal shares the id
            setattr(raw.state, AUDITED_STATE_KEY, job.request_id)
        first = await run_until_disconnect(raw.receive, _first_output(job, qos))
        if stream:
            failures: list[BaseException] = []
            response = SSEResponse(
                _guarded(render_stream(iterate(first, job)), failures),
                on_close=lambda: cleanup(_stream_outcome(failures, job)),
            )
            _set_precision_header(response, job)
            handed_off = True
            return response
        results = await run_until_disconnect(raw.receive, collect(first, job))
        body = render_final(results)
        outcome = Outcome.OK
        response = Response(content=body.model_dump_json(), media_type="application/json")
        _set_precision_header(response, job)
        return response
    except ClientDisconnected:
        logger.info("client disconnected; request %s aborted", job.request_id)
        return Response(status_code=CLIENT_CLOSED_STATUS)
    except Exception as exc:
        outcome = outcome_of(exc)
        err = to_server_error(exc)
        if err is exc:
            raise
        raise err from exc
    finally:
        if not handed_off:
            await cleanup(outcome)


def _set_precision_header(response: Response, job: GenerationJob) -> None:
    """Put the job's weight set (`GenerationJob.precision`) in `x-sits-precision`, if known."""
    if job.precision is not None:
        response.headers[PRECISION_HEADER] = job.precision


async def _first_output(job: GenerationJob, qos: QosTicket) -> Any:
    """The job's first output; with a queue timeout (`QosTicket.queue_timeout_s`), a 503
    `overloaded` when the engine dropped the job unstarted at its start deadline (set by
    `serve_job`), or, as a backstop, when no output came within `QUEUE_BACKSTOP_FACTOR` x the
    timeout (the job is then closed by `serve_job`). The engine decides, not a timer here:
    a request it started just before the deadline runs on, so its prefill is not thrown away
    (on the H200, a timer here shed ~8 requests/s right after their prefill)."""
    if qos.queue_timeout_s is None:
        return await job.next()
    try:
        item = await asyncio.wait_for(job.next(), QUEUE_BACKSTOP_FACTOR * qos.queue_timeout_s)
    except TimeoutError:
        pass
    else:
        if item is None or not was_dropped_unstarted(item[1]):
            return item
    retry_s = qos.retry_after_s
    raise ServerError(
        503,
        f"Shed: tenant '{qos.tenant.id}' ({qos.tenant.tier.value}, beyond its reservation) "
        f"got no first token within its {qos.queue_timeout_s:g} s first-token limit while "
        f"queued. Retry after {retry_s} s.",
        type="service_unavailable_error",
        code="overloaded",
        headers=retry_after_headers(retry_s),
    )


def _stream_outcome(failures: list[BaseException], job: GenerationJob) -> Outcome:
    """How a stream ended: its error, every prompt finished, or else an abort (the client
    left early; a disconnect seen just after the last frame still counts as served)."""
    if failures:
        return outcome_of(failures[0])
    return Outcome.OK if job.all_finished else Outcome.ABORT
