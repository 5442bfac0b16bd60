"""`AsyncLLM`: the asyncio front end of the engine, used by the HTTP server.

The engine loop (`sits.engine.engine_loop.EngineLoop`) runs either in a thread of this process
(`sits.engine.thread_transport`, the default) or in a child process (`engine_process=True`,
`sits.engine.process_transport`, `sits serve --engine-process`); the front end knows only a
transport object (`send(command)`, `start`, `alive`, `stop`, `loop_times`) and the messages
of `sits.engine.messages`. This side keeps the tokenizer and the `OutputProcessor`
(detokenization), so HTTP work never runs on the step loop; events arrive on the transport's
thread (the engine thread, or the process transport's reader) in `_on_event`, which keeps the
newest stats snapshot (by `EngineStats.time_s`: a snapshot taken after commands can overtake
an older step's) and posts outputs, failed adds and call results to the asyncio loop of the
latest `generate` or call with `call_soon_threadsafe`. Outputs reach each request's queue a
batch per event-loop iteration (`BatchedDelivery`, below).

Invariants: every request that leaves `generate` unfinished (client gone, task cancelled) is
aborted (`FinishRequests`) and its KV blocks freed at the next loop iteration; a request that
can never run (prompt, limits: `EngineCore.add_request`) is refused by the loop and reaches
`generate`'s caller before anything is yielded; when the loop dies (a failure, a killed child)
every in-flight request and pending call gets `EngineDeadError` at once, `is_healthy()` turns
False and `generate` raises `EngineDeadError`.

Engine calls (`expert_stats`, `freeze_expert`, ..., `set_precision`, `prefill_chunks`) are
named `EngineCall`s run by the loop between steps; their errors are rebuilt with their class
and message. `stats()` and `precision_state()` read the newest snapshot, which the loop sends
before each call's result (so a caller sees its call's effect). MoE experts: the loop reads
the device-side expert counters every `engine_loop.EXPERT_STATS_PERIOD_STEPS` steps, when it
goes idle and on request, into `EngineStats.experts`; with spare expert slots or
`restore_frozen_experts` that read also restores the experts the health check froze
(`ExpertMonitor.read` with `auto_restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from enum import Enum
from typing import Any

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, InvalidParameterError
from sits.core.outputs import EngineCoreOutput, RequestOutput
from sits.core.precision import PrecisionState
from sits.core.request import FinishReason
from sits.core.sampling_params import SamplingParams
from sits.engine.arg_utils import ENGINE_STEP_TIMEOUT_S
from sits.engine.engine_loop import hung_loop_error
from sits.engine.messages import (
    AddFailed,
    AddRequest,
    CallResult,
    Command,
    EngineCall,
    EngineDied,
    Event,
    FinishRequests,
    Heartbeat,
    RecordTimeline,
    SetBorrowingTiers,
    StatsUpdate,
    StepOutputs,
    unpack_error,
)
from sits.engine.output_processor import OutputProcessor, child_request_ids, make_engine_requests
from sits.engine.process_transport import ProcessTransport
from sits.engine.stats import EngineStats, PrefillChunk, parse_tiers
from sits.engine.step_watch import STALL_FLOOR_S, stall_limit_s, stall_reason
from sits.engine.thread_transport import ThreadTransport
from sits.runner.expert_health import DEFAULT_FREEZE_AFTER, ExpertStats
from sits.sched.config import TenantPolicy

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 5.0


class AsyncLLM:
    """Asynchronous engine front end (see the module docstring).

    Args:
        config: engine configuration.
        engine_process: run the engine loop in a child process instead of a thread.
        health_timeout_s: unhealthy when, between steps, the loop has neither sent anything
            (outputs, stats, its idle heartbeat) nor turned for this many seconds
            (`hung_loop_error`).
        step_timeout_s: ... or when one step has run this many seconds (a hung step; a long
            one, such as a big prompt chunk on a CPU, stays healthy until then).
        stall_floor_s: a step counts as stalled (`stall_reason`: /health answers 503, the
            engine lives on) after 10x the engine's slow steps and at least this many
            seconds (`sits.engine.step_watch`); None = 5 s on CUDA, 30 s on the CPU.
        tenant_policies: the scheduler's tenants (`sits.engine.builder.tenant_policies_of`);
            () for plain FCFS.
        expert_freeze_after: consecutive anomalous (non-finite output) checks that freeze an
            MoE expert; 0 disables automatic freezing.
        restore_frozen_experts: reload an expert frozen by the health check from the
            checkpoint and unfreeze it when the loop next reads the expert stats (the disk
            read runs on the loop, between steps). Always on with spare expert slots
            (`config.num_spare_experts` > 0), which the reload then uses.

    Attributes:
        engine_core: the `EngineCore` in thread mode (for recorders and tests); None with
            `engine_process`.
        transport: the `ThreadTransport` or `ProcessTransport`.
        errored: the loop died (not by `shutdown`).
        dead_error: why the engine is dead or hung, or None.

    Raises:
        SitsError (ModelNotFoundError, UnsupportedModelError, InvalidParameterError, ...):
            building the engine failed (with `engine_process`: the child's class and message);
            `engine_process` with tensor_parallel_size > 1 ("engine_process").
        EngineDeadError: the engine process exited during startup without saying why.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        engine_process: bool = False,
        health_timeout_s: float = 10.0,
        step_timeout_s: float = ENGINE_STEP_TIMEOUT_S,
        stall_floor_s: float | None = None,
        tenant_policies: tuple[TenantPolicy, ...] = (),
        expert_freeze_after: int = DEFAULT_FREEZE_AFTER,
        restore_frozen_experts: bool = False,
    ) -> None:
        if engine_process and config.tensor_parallel_size > 1:
            raise InvalidParameterError(
                "engine_process",
                f"--engine-process is not supported with tensor_parallel_size "
                f"{config.tensor_parallel_size} yet (its daemon process cannot start workers)",
            )
        kind = ProcessTransport if engine_process else ThreadTransport
        transport = kind(
            config, tuple(tenant_policies), expert_freeze_after, restore_frozen_experts
        )
        self.transport: ThreadTransport | ProcessTransport = transport
        self.engine_core = getattr(transport, "core", None)
        self.config = config
        self.tokenizer = transport.tokenizer
        self.info = transport.info
        self.max_model_len = transport.info.max_model_len
        # The KV blocks requests may use (less the null block) and their size in tokens: the
        # server caps an unset max_tokens to what the cache holds.
        self.num_kv_blocks = transport.stats.num_total_blocks
        self.block_size = config.block_size
        self.model_name = config.model_name
        self.health_timeout_s = health_timeout_s
        self.step_timeout_s = step_timeout_s
        self.stall_floor_s = (
            stall_floor_s
            if stall_floor_s is not None
            else STALL_FLOOR_S.get(transport.info.device.type, STALL_FLOOR_S["cpu"])
        )
        self.errored = False
        self.dead_error: BaseException | None = None
        self._stats: EngineStats = transport.stats
        self._processor = OutputProcessor(self.tokenizer)
        self._delivery = BatchedDelivery()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._heartbeat_s = time.monotonic()
        transport.start(self._on_event, self._on_closed)

    # ---- public API ---------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The engine process's id; None in thread mode."""
        return self.transport.pid

    def is_healthy(self) -> bool:
        """True while the engine loop is alive and keeps turning (a step within
        `step_timeout_s`); cheap, never blocks. A hung loop's reason becomes `dead_error`."""
        if self.errored or self._stopping or not self.transport.alive():
            return False
        step_started_s, turned_s, _ = self.transport.loop_times.read()
        error = hung_loop_error(
            time.monotonic(),
            max(self._heartbeat_s, turned_s),
            step_started_s or None,
            self.health_timeout_s,
            self.step_timeout_s,
        )
        if error is not None and self.dead_error is None:
            self.dead_error = error
        return error is None

    def stall_reason(self) -> str | None:
        """Why the running step counts as stalled (it has run past its stall limit,
        `sits.engine.step_watch`), or None; the engine stays alive (the hard step timeout
        decides that). Cheap, never blocks."""
        step_started_s, _, typical_s = self.transport.loop_times.read()
        if not step_started_s:
            return None
        elapsed_s = time.monotonic() - step_started_s
        limit_s = stall_limit_s(typical_s, self.stall_floor_s, self.step_timeout_s)
        return stall_reason(elapsed_s, typical_s, limit_s) if elapsed_s > limit_s else None

    def stats(self) -> EngineStats:
        """The newest load snapshot the loop sent."""
        return self._stats

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
        self._send(AddRequest(request_id, tuple(children)))
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

    def set_borrowing_tiers(self, tiers: Iterable[str | Enum]) -> None:
        """Let only tenants of `tiers` start work beyond their reservation (overload control).

        Args:
            tiers: tier values ("guaranteed", "burstable", "best_effort") or tier enums; all
                three restore normal borrowing. Applied by the loop before its next step;
                running requests are not touched. No effect without configured tenants.

        Raises:
            ValueError: an unknown tier.
        """
        self._send(SetBorrowingTiers(parse_tiers(tiers)))

    async def expert_stats(self) -> ExpertStats | None:
        """A fresh read of the MoE experts' counters (None for a dense model).

        Raises:
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._call("expert_stats")

    async def freeze_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Mask expert `expert_id` of decoder layer `layer_id` in its router from the next step.

        Returns:
            The experts' stats right after.

        Raises:
            InvalidParameterError: a dense model, no such MoE layer or expert, or too few
                experts would be left.
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._call("freeze_expert", layer_id, expert_id)

    async def unfreeze_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Route to the expert again (see `freeze_expert`; same errors)."""
        return await self._call("unfreeze_expert", layer_id, expert_id)

    async def restore_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """Reload the expert's weights from the checkpoint and unfreeze it (see
        `freeze_expert`; also UnsupportedModelError when the checkpoint lacks them)."""
        return await self._call("restore_expert", layer_id, expert_id)

    async def set_precision(self, name: str) -> PrecisionState:
        """Run weight set `name` from the next step on (applied by the loop between steps;
        requests in flight continue on their KV).

        Args:
            name: one of `precision_state().available` ("fp8" / "int4" or the model dtype's
                "bf16" / "fp16" / "fp32").

        Returns:
            The state right after the switch (its step and delay fill in once the first step
            in the new set has run).

        Raises:
            InvalidParameterError: no precision switch configured, or an unknown name.
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._call("set_precision", name, time.monotonic())

    def precision_state(self) -> PrecisionState:
        """The weight sets and the last switch, from the newest snapshot (sent before each
        call's result, so a `set_precision` caller sees its switch)."""
        state = self._stats.precision
        assert state is not None, "every snapshot of a started engine carries it"
        return state

    async def prefill_chunks(self) -> list[PrefillChunk]:
        """The latest prompt chunks the engine computed, oldest first (`StepStats.prefill_chunks`,
        a bounded ring; copied by the loop between steps).

        Raises:
            EngineDeadError: the engine loop is dead or hung.
        """
        return await self._call("prefill_chunks")

    def record_timeline(self, enabled: bool = True) -> None:
        """Stamp each request's prompt chunks and detokenization time on its
        `RequestMetrics` (`prefill_chunks`, `detokenize_s`), for tracing; off by default.

        Requests added after the call are stamped; chunks computed before it are not.
        """
        self._send(RecordTimeline(enabled))
        self._processor.time_detokenize = enabled

    async def shutdown(self) -> None:
        """Stop the engine loop (an engine process is terminated after a timeout); unfinished
        requests and pending calls get EngineDeadError."""
        self._stopping = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.transport.stop, _STOP_TIMEOUT_S)
        self._on_dead(EngineDeadError("the engine was shut down"))

    # ---- asyncio side -------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        """Hand `command` to the loop (never blocks)."""
        self.transport.send(command)

    def _check_alive(self) -> None:
        if not self.is_healthy():
            reason = self.dead_error or "the engine loop is not responding"
            raise EngineDeadError(f"engine is not available: {reason}")

    async def _call(self, name: str, *args: object) -> Any:
        """Run the loop's named call between steps and return (or raise) its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        self._loop = loop
        call_id = next(self._call_ids)
        future = loop.create_future()
        self._calls[call_id] = future
        self._send(EngineCall(call_id, name, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _resolve(self, result: CallResult) -> None:
        future = self._calls.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.ok:
            future.set_result(result.value)
        else:
            future.set_exception(unpack_error(result.value))

    def _abort_now(self, request_id: str) -> None:
        open_ids = self._processor.remove_request(request_id)
        if open_ids:
            self._send(FinishRequests(tuple(open_ids), FinishReason.ABORT))

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        processed = self._processor.process(outputs)
        for child_id, stop_str in processed.stop_requests:
            self._send(FinishRequests((child_id,), FinishReason.STOP, stop_str))
        self._delivery.put(processed.request_outputs)  # a batch per loop iteration

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        sink = self._processor.sink_of(request_id)
        open_ids = self._processor.remove_request(request_id)
        if open_ids:
            self._send(FinishRequests(tuple(open_ids), FinishReason.ABORT))
        if sink is not None:
            self._delivery.flush()  # the outputs made before the error arrive before it
            sink.put_nowait(error)

    def _on_dead(self, error: BaseException) -> None:
        for request_id in self._processor.request_ids():
            self._fail_request(request_id, error)
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    # ---- the transport's thread ---------------------------------------------------------

    def _post(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the asyncio loop of the latest `generate` or call; dropped when
        there is none or it has closed (e.g. after `asyncio.run` returned: nobody awaits its
        outputs), so a closed loop never kills the transport's thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed between the check and the call
            loop.call_soon_threadsafe(fn, *args)

    def _on_event(self, event: Event) -> None:
        """Take one event from the loop (on the transport's thread)."""
        self._heartbeat_s = time.monotonic()
        match event:
            case StepOutputs(outputs, stats):
                self._take_stats(stats)
                if outputs:
                    self._post(self._deliver, outputs)
            case StatsUpdate(stats):
                self._take_stats(stats)
            case AddFailed(request_id, error):
                self._post(self._fail_request, request_id, unpack_error(error))
            case CallResult():
                self._post(self._resolve, event)
            case Heartbeat():
                pass
            case EngineDied(error):
                self.dead_error = unpack_error(error)
            case _:
                raise TypeError(f"not an engine event: {event!r}")

    def _take_stats(self, stats: EngineStats | None) -> None:
        """Keep `stats` unless it is older than the snapshot held (module docstring)."""
        if stats is not None and stats.time_s >= self._stats.time_s:
            self._stats = stats

    def _on_closed(self, why: str) -> None:
        """The loop's events ended (`why`: the thread or process exited): unless `shutdown`
        asked for it, fail everything in flight."""
        if self._stopping and self.dead_error is None:
            return
        if self.dead_error is None:
            self.dead_error = EngineDeadError(why)
        self.errored = True
        logger.error("engine loop died: %s", self.dead_error)
        self._post(self._on_dead, EngineDeadError(f"the engine loop died: {self.dead_error!r}"))


# Outputs handed over per event-loop iteration. A stream chunk costs the HTTP side ~50-90 us,
# so an iteration stays within ~6 ms. On a CPU (bench/accept_delay.py: 400 streams x 95 us
# every 40 ms, 100 new connections a second, uvloop) new requests waited 16.0 ms at the median
# with 64 a batch, 9.7 ms with 32 and 1,965 ms with the whole step at once; the HTTP process's
# CPU per streamed token (bench/http_cpu.sh: the demo model, 200 streams) was 85 us with 64,
# 86-87 us with the whole step and 91-98 us with 32.
DELIVERY_BATCH = 64


class BatchedDelivery:
    """A FIFO of (queue, item) pairs drained `batch` per event-loop iteration.

    Each hand-off wakes the request's task, which then formats and writes its stream chunk in
    the event loop's next iteration. A step's outputs handed over at once (~400 streams on a
    busy server) make that next iteration 20-30 ms of Python work. The loop polls its sockets
    only between iterations, and uvloop accepts one new connection per poll (libuv 1.45 and
    later, libuv/libuv#3696). When iterations last longer than the gap between arriving
    connections (~11 ms at 90 a second), the kernel's accept queue grows, and new requests wait
    there unseen by the app and its metrics: in one 120-s run on the H200 every request sent in
    a 5-s window waited ~1-1.5 s, even those refused at once (bench/RESULTS.md, 2026-11-30
    eighth session). On a CPU, a uvloop server whose iterations took 20 ms kept 100 new
    connections a second waiting 1.7 s at the median, with 157 in the accept queue at the peak;
    asyncio's loop, which accepts up to 100 per poll, kept them 0.1 s (bench/accept_delay.py
    measures it). It hands over at most `batch` outputs per iteration, in arrival order, so the
    loop returns to its sockets every `batch` outputs; the work is the same, spread over more
    iterations.

    Invariants: items reach each queue in the order `put` received them; `flush` empties the
    backlog at once (before an error is put directly on a queue, so it arrives after the outputs
    that preceded it).

    Args:
        batch: pairs handed over per iteration (>= 1).

    Raises:
        ValueError: batch < 1.
    """

    def __init__(self, batch: int = DELIVERY_BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch = batch
        self._pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self._scheduled_on: asyncio.AbstractEventLoop | None = None  # loop of the next drain

    def __len__(self) -> int:
        """Pairs not handed over yet."""
        return len(self._pending)

    def put(self, items: Iterable[tuple[asyncio.Queue, Any]]) -> None:
        """Queue `items` behind the backlog and hand over the first batch now; the rest follow
        one batch per loop iteration. Outside a running loop everything goes at once. A drain
        left scheduled on another loop (one `asyncio.run` ended with a backlog) is taken over
        by this one."""
        self._pending.extend(items)
        if self._scheduled_on is None or self._scheduled_on is not _running_loop():
            self._drain()

    def flush(self) -> None:
        """Hand over the whole backlog now."""
        while self._pending:
            queue, item = self._pending.popleft()
            queue.put_nowait(item)

    def _drain(self) -> None:
        self._scheduled_on = None
        loop = _running_loop()
        if loop is None:
            self.flush()
            return
        pending = self._pending
        for _ in range(min(self.batch, len(pending))):
            queue, item = pending.popleft()
            queue.put_nowait(item)
        if pending:
            self._scheduled_on = loop
            loop.call_soon(self._drain)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
