"""The job one HTTP request runs, pumped until it ends or the client goes, and its SSE stream.

`GenerationJob`: the engine requests of one HTTP request, merged into one output queue.

One HTTP request holds one engine request per prompt (a completion may carry a batch of
prompts; each engine request handles its own n samples). A pump task per prompt iterates
`engine.generate` and puts `(prompt_index, RequestOutput)` items into one asyncio queue, so
the handler reads a single merged stream whatever the number of prompts.

Invariants:
- `close()` always runs (handlers use `async with`): it cancels the pumps still running, which
  closes their generators and so aborts the engine requests and frees their KV blocks at once,
  then calls `engine.abort` for every unfinished request as a second guard.
- `fail(exc)` (used by drain and by engine-death handling) makes the next `next()` raise `exc`
  and stops the pumps; outputs queued before it are still delivered first.
- HTTP work never runs on the engine's step loop: pumps only move finished Python objects.
- `used_tokens` counts what the engine really consumed for the job (rate-limit
  reconciliation): the prompt tokens of every prompt that produced an output, plus every
  generated token delivered.
- with an audit (`--audit-log`), each engine request is watched by a `RequestAudit` that sees
  every output first and hands on a copy trimmed to the user's logprobs; its record's id is
  `request_id` (one prompt) or `f"{request_id}-{i}"`; it ends as finished, abort or error, and
  carries `trace_id` (set by tracing before `start()`; None when the request is not traced).
- `precision` is the weight set (`RequestOutput.precision`, with `--precision-switch`) of the
  latest output `next()` handed out: the first one's once the response starts, the last one's
  once every output was read; None without a switch.

The client side: server-sent events (`data: {json}\\n\\n` frames, `data: [DONE]`) and a
response that notices a client going away.

`SSEResponse` sends the events of an async iterator while a second task waits for the ASGI
`http.disconnect` message; whichever ends first stops the other, and `on_close` runs in every
case (the handler closes its engine job there, which aborts the engine requests and frees their
KV blocks at once). A send that fails because the socket is gone counts as a disconnect.

Also `wait_for_disconnect` / `run_until_disconnect`, used by non-streamed handlers, which need
the same guarantee while they wait for the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sits.core.errors import InvalidParameterError, PromptTooLongError
from sits.core.outputs import RequestOutput
from sits.core.request import START_DEADLINE_MISSED
from sits.core.sampling_params import SamplingParams
from sits.obs.output_observer import OutputObserver
from sits.server.engine_client import EngineClient

if TYPE_CHECKING:
    from sits.obs.request_audit import ServerAudit

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 2.0
DONE_EVENT = "data: [DONE]\n\n"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EnginePrompt:
    """One prompt of a job: its text (when given as text), token ids and sampling params."""

    text: str | None
    token_ids: list[int]
    params: SamplingParams


class _ObserverPair(OutputObserver):
    """Hands every call to two observers, in order."""

    def __init__(self, first: OutputObserver, second: OutputObserver) -> None:
        self.first = first
        self.second = second

    def on_output(self, output: RequestOutput) -> None:
        self.first.on_output(output)
        self.second.on_output(output)

    def on_abort(self) -> None:
        self.first.on_abort()
        self.second.on_abort()


@dataclass(slots=True)
class _PromptDone:
    index: int


def was_dropped_unstarted(output: RequestOutput) -> bool:
    """True for the output of an engine request dropped at its start deadline (never started:
    finished, no tokens, stop_reason `START_DEADLINE_MISSED`)."""
    return output.finished and all(
        c.stop_reason == START_DEADLINE_MISSED and not c.token_ids for c in output.outputs
    )


class GenerationJob:
    """The engine requests of one HTTP request and their merged outputs.

    Args:
        engine: the engine front end.
        request_id: the HTTP request's id; prompt i runs as engine request
            `request_id` (one prompt) or `f"{request_id}-p{i}"`.
        prompts: the prompts, each with its sampling params.
        tenant_id, priority, cache_salt: passed to the engine.
        make_observer: builds an observer per prompt (metrics); None for none.
        audit: the server's audit log; None when auditing is off.

    Attributes:
        start_deadline_s: time.monotonic() seconds by which the engine must have started
            each prompt, else it drops it (`Request.start_deadline_s`; see
            `was_dropped_unstarted`); set before `start()`. None: no deadline.
        precision: the weight set of the latest output handed out (see the module
            docstring); None before the first or without a precision switch.
    """

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompts: list[EnginePrompt],
        *,
        tenant_id: str = "default",
        priority: int = 0,
        cache_salt: str | None = None,
        make_observer: Callable[[EnginePrompt], OutputObserver] | None = None,
        audit: ServerAudit | None = None,
    ) -> None:
        assert prompts, "a job needs at least one prompt"
        self.engine = engine
        self.request_id = request_id
        self.prompts = prompts
        self.tenant_id = tenant_id
        self.priority = priority
        self.cache_salt = cache_salt
        self.engine_request_ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-p{i}" for i in range(len(prompts))]
        )
        self._make_observer = make_observer or (lambda _p: OutputObserver())
        self.audit = audit
        self.trace_id: str | None = None  # the W3C trace id (32 hex) when traced
        self.start_deadline_s: float | None = None
        self.precision: str | None = None
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | _PromptDone | BaseException] = (
            asyncio.Queue()
        )
        self._pumps: list[asyncio.Task[None]] = []
        self._finished = [False] * len(prompts)
        self._started = [False] * len(prompts)  # produced at least one output
        self.num_generated_tokens = 0
        self._num_open = len(prompts)
        self._failure: BaseException | None = None
        self._closed = False

    def add_observer(self, make_observer: Callable[[EnginePrompt], OutputObserver]) -> None:
        """Give each prompt a further observer built by `make_observer` (tracing).

        Call before `start()`.
        """
        assert not self._pumps, "observers are added before the job starts"
        first = self._make_observer
        self._make_observer = lambda prompt: _ObserverPair(first(prompt), make_observer(prompt))

    def start(self) -> None:
        """Start one pump task per prompt."""
        for index, prompt in enumerate(self.prompts):
            self._pumps.append(asyncio.create_task(self._pump(index, prompt)))

    async def _pump(self, index: int, prompt: EnginePrompt) -> None:
        observer = self._make_observer(prompt)
        finished = False
        failed = False
        refused = False  # the engine refused it before any output (a 400): not an abort
        produced = False
        gen = None
        params = prompt.params
        watcher = None
        if self.audit is not None:
            audit_id = self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"
            watcher = self.audit.watch(
                audit_id,
                self.tenant_id,
                prompt.token_ids,
                prompt.text,
                prompt.params,
                trace_id=self.trace_id,
            )
            params = self.audit.engine_params(prompt.params)
        try:
            gen = self.engine.generate(
                self.engine_request_ids[index],
                prompt.token_ids,
                params,
                prompt=prompt.text,
                tenant_id=self.tenant_id,
                priority=self.priority,
                cache_salt=self.cache_salt,
                start_deadline_s=self.start_deadline_s,
            )
            async for output in gen:
                produced = True
                if watcher is not None:
                    output = watcher.on_output(output)
                self._started[index] = not was_dropped_unstarted(output)
                self.num_generated_tokens += sum(len(c.token_ids) for c in output.outputs)
                observer.on_output(output)
                finished = output.finished
                self._queue.put_nowait((index, output))
            self._queue.put_nowait(_PromptDone(index))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            failed = True
            refused = not produced and isinstance(exc, InvalidParameterError | PromptTooLongError)
            self._queue.put_nowait(exc)
        finally:
            self._finished[index] = finished
            if not finished and not refused:
                observer.on_abort()
            if watcher is not None:
                watcher.finish("error" if failed else "abort")
            if gen is not None:
                with contextlib.suppress(BaseException):
                    await gen.aclose()  # type: ignore[attr-defined]

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next (prompt index, output), or None once every prompt has finished.

        Raises:
            BaseException: what the engine raised for a prompt, or what `fail` was given.
        """
        while True:
            if self._num_open == 0:
                return None
            item = await self._queue.get()
            if isinstance(item, _PromptDone):
                self._num_open -= 1
                continue
            if isinstance(item, BaseException):
                self._num_open = 0
                raise item
            self.precision = item[1].precision or self.precision
            return item

    def fail(self, exc: BaseException) -> None:
        """Make the consumer's next `next()` raise `exc` (after queued outputs) and stop pumps."""
        if self._failure is not None or self._closed:
            return
        self._failure = exc
        for pump in self._pumps:
            pump.cancel()
        self._queue.put_nowait(exc)

    @property
    def used_tokens(self) -> int:
        """Prompt tokens of the prompts that produced output plus the generated tokens."""
        prompt_tokens = sum(
            len(p.token_ids) for p, started in zip(self.prompts, self._started) if started
        )
        return prompt_tokens + self.num_generated_tokens

    @property
    def all_finished(self) -> bool:
        """True when every engine request delivered its finished output."""
        return all(self._finished)

    async def close(self) -> None:
        """Stop the pumps and abort every unfinished engine request (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:
            pump.cancel()
        if self._pumps:
            await asyncio.gather(*self._pumps, return_exceptions=True)
        for index, request_id in enumerate(self.engine_request_ids):
            if self._finished[index]:
                continue
            try:
                await asyncio.wait_for(self.engine.abort(request_id), _ABORT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the engine may be dead; nothing more to free
                logger.debug("abort of %s failed", request_id, exc_info=True)

    async def __aenter__(self) -> GenerationJob:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was complete."""


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One `data:` frame holding `payload` as compact JSON."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json()
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports that the client disconnected.

    Call only after the request body has been read (FastAPI reads it before the handler).
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first.

    Raises:
        ClientDisconnected: the client went away first (`work` was cancelled).
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work_task, watcher, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


class SSEResponse(Response):
    """A `text/event-stream` response fed by an async iterator of ready-made frames.

    Args:
        events: yields complete frames (see `sse_event`), as text or as UTF-8 bytes (the fleet
            router relays a replica's bytes as they came); the response ends when it ends.
        on_close: awaited exactly once when the response ends, however it ends.
    """

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[str | bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        super().__init__(content=None, status_code=200, media_type=self.media_type)
        del self.headers["content-length"]  # streamed: chunked transfer, no fixed length
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"
        self._events = events
        self._on_close = on_close
        self.client_disconnected = False

    async def _send_all(self, send: Send) -> None:
        async for frame in self._events:
            body = frame if isinstance(frame, bytes) else frame.encode()
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            streamer = asyncio.ensure_future(self._send_all(send))
            watcher = asyncio.ensure_future(wait_for_disconnect(receive))
            try:
                await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (streamer, watcher):
                    if not task.done():
                        task.cancel()
                await asyncio.gather(streamer, watcher, return_exceptions=True)
            if watcher.done() and not watcher.cancelled():
                self.client_disconnected = True
            elif not streamer.cancelled() and streamer.exception() is not None:
                exc = streamer.exception()
                if isinstance(exc, OSError):
                    self.client_disconnected = True
                else:
                    logger.error("stream failed", exc_info=exc)
        except OSError:
            self.client_disconnected = True
        finally:
            with contextlib.suppress(Exception):
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            await self._on_close()
