"""`RequestFrontEnd`: the request side every asyncio engine front end shares.

`AsyncLLM` (engine loop in a thread) and `AsyncMPLLM` (engine loop in a child process) differ
only in how a command reaches the engine (`_send`) and how outputs come back; both keep the
tokenizer and the `OutputProcessor` (detokenization) on the asyncio side. This base holds
what is the same: `generate` (one asyncio queue per request), `abort`, delivering a step's
outputs (`BatchedDelivery`: a batch per event-loop iteration) and failing requests.
Invariants: every request that leaves `generate` unfinished (client gone, task cancelled) is
aborted through `_send(("finish", ...))`; `_deliver`, `_fail_request` and `_fail_all` run on
the asyncio loop only. A request that can never run (prompt, limits: `EngineCore.add_request`)
is refused on the engine side, in both front ends alike, and reaches `generate`'s caller
through `_fail_request` before anything is yielded.

Commands a subclass's engine side must accept (tuples, first item the kind):
("add", request_id, children), ("finish", child_ids, FinishReason, stop_reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from enum import Enum

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, InvalidParameterError
from sits.core.outputs import EngineCoreOutput, RequestOutput
from sits.core.request import FinishReason
from sits.core.sampling_params import SamplingParams
from sits.engine.delivery import BatchedDelivery
from sits.engine.health import hung_loop_error
from sits.engine.output_processor import OutputProcessor
from sits.engine.requests import child_request_ids, make_engine_requests
from sits.runner.model_info import ModelInfo
from sits.sched.config import TenantTier


def parse_tiers(tiers: Iterable[str | Enum]) -> frozenset[TenantTier]:
    """The tiers of `set_borrowing_tiers`: tier values or tier enums.

    Raises:
        ValueError: an unknown tier.
    """
    values = {tier.value if isinstance(tier, Enum) else str(tier) for tier in tiers}
    return frozenset(TenantTier(value) for value in values)


def tier_values(tiers: frozenset[TenantTier]) -> tuple[str, ...]:
    """`tiers` as values in the enum's order (`EngineStats.borrowing_tiers`)."""
    return tuple(t.value for t in TenantTier if t in tiers)


class RequestFrontEnd:
    """Base of the asyncio front ends (see the module docstring).

    Subclasses set `config`, `info`, `max_model_len`, `dead_error`, `_processor`, `_delivery`
    and `_loop`, and define `is_healthy()` and `_send(command)`.
    """

    config: EngineConfig
    info: ModelInfo
    max_model_len: int
    dead_error: BaseException | None
    health_timeout_s: float
    step_timeout_s: float
    _processor: OutputProcessor
    _delivery: BatchedDelivery
    _loop: asyncio.AbstractEventLoop | None

    def is_healthy(self) -> bool:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def _loop_turning(self, turned_s: float, step_started_s: float | None) -> bool:
        """Whether the engine loop keeps turning (`hung_loop_error` with this front end's
        timeouts, at the last turn `turned_s` and the running step's start, None between
        steps); a hung loop's reason becomes `dead_error`."""
        error = hung_loop_error(
            time.monotonic(), turned_s, step_started_s, self.health_timeout_s, self.step_timeout_s
        )
        if error is not None and self.dead_error is None:
            self.dead_error = error
        return error is None

    def _send(self, command: tuple) -> None:  # pragma: no cover - defined by subclasses
        """Hand `command` to the engine side (never blocks for long)."""
        raise NotImplementedError

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        tenant_id: str = "default",
        priority: int = 0,
        cache_salt: str | None = None,
        start_deadline_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Run one request; yields RequestOutputs as `params.output_kind` says.

        `start_deadline_s` (time.monotonic()): if the engine has not started it by then, it
        ends with finish_reason "abort", stop_reason `START_DEADLINE_MISSED` and no tokens.

        Raises:
            InvalidParameterError, PromptTooLongError: before anything is yielded.
            EngineDeadError: the engine loop is dead or hung (at once), or died meanwhile.
        """
        self._check_alive()
        if self._processor.has_request(request_id):
            raise InvalidParameterError("request_id", f"request id {request_id!r} is in use")
        children = make_engine_requests(
            request_id,
            prompt_token_ids,
            params,
            eos_token_ids=self.info.eos_token_ids,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.config.enable_prefix_caching,
            tenant_id=tenant_id,
            priority=priority,
            cache_salt=cache_salt,
            start_deadline_s=start_deadline_s,
        )
        self._loop = asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self._processor.add_request(
            request_id,
            child_request_ids(request_id, params.n),
            prompt,
            list(prompt_token_ids),
            params,
            children[0].arrival_time,
            sink,
        )
        self._send(("add", request_id, children))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are freed at the engine's next loop iteration."""
        self._abort_now(request_id)

    def _check_alive(self) -> None:
        if not self.is_healthy():
            reason = self.dead_error or "the engine loop is not responding"
            raise EngineDeadError(f"engine is not available: {reason}")

    def _abort_now(self, request_id: str) -> None:
        open_ids = self._processor.remove_request(request_id)
        if open_ids:
            self._send(("finish", open_ids, FinishReason.ABORT, None))

    def _post(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the asyncio loop of the latest `generate` (from the engine's
        thread); dropped when there is none or it has closed (e.g. after `asyncio.run`
        returned: nobody awaits its outputs), so a closed loop never kills the engine side."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed between the check and the call
            loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        processed = self._processor.process(outputs)
        for child_id, stop_str in processed.stop_requests:
            self._send(("finish", [child_id], FinishReason.STOP, stop_str))
        self._delivery.put(processed.request_outputs)  # a batch per loop iteration

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        sink = self._processor.sink_of(request_id)
        open_ids = self._processor.remove_request(request_id)
        if open_ids:
            self._send(("finish", open_ids, FinishReason.ABORT, None))
        if sink is not None:
            self._delivery.flush()  # the outputs made before the error arrive before it
            sink.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in self._processor.request_ids():
            self._fail_request(request_id, error)
