"""`AsyncMPLLM`: `AsyncLLM`'s public API with the `EngineCore` step loop in a child process.

In `AsyncLLM` the engine thread runs Python (kernel launches) almost nonstop, so the HTTP
event loop waits for the GIL on every socket call. Here the step loop runs in a "spawn"
child (`sits.engine.engine_proc`), which has its own GIL; this process keeps the tokenizer
and the `OutputProcessor` (detokenization), as `AsyncLLM` does, and shares its request side
(`RequestFrontEnd`: `generate`, `abort`). Commands go to the child over a pipe (no closures:
the expert and prefill-chunk methods are named calls with a call id); ONE reader thread
blocks on the child's pipe and hands outputs, failed adds and call results to the asyncio
loop with `call_soon_threadsafe`; stats snapshots and the heartbeat are plain attribute
writes. ONE writer thread sends the commands, in order, from a queue the loop fills: a pipe
holds 64 KiB (about 16 adds of 512-token prompts) and the child reads it only between steps,
so a send from the loop itself blocked every stream of the server until the step ended
(measured on the CPU under a flood: 18-46 s of loop lag). Request checks (prompt length,
vocabulary) run in the child: their errors still reach `generate`'s caller before anything
is yielded.

Failure handling: when the child dies (killed, loop exception) the reader sees the pipe close
and every in-flight request and pending call gets `EngineDeadError` at once; `is_healthy()`
turns False and `generate` raises `EngineDeadError`. An error while the child builds the
engine is raised by the constructor with the child's exception class and message.
`shutdown()` asks the child to stop, joins it, and terminates (then kills) it after a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Iterable
from enum import Enum
from typing import Any

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError
from sits.core.precision import PrecisionState
from sits.engine.async_llm import EngineStats
from sits.engine.delivery import BatchedDelivery
from sits.engine.engine_proc import PackedError, run_engine_proc, unpack_error
from sits.engine.front_end import RequestFrontEnd, parse_tiers
from sits.engine.health import ENGINE_STEP_TIMEOUT_S
from sits.engine.output_processor import OutputProcessor
from sits.engine.step_stats import PrefillChunk
from sits.runner.expert_health import DEFAULT_FREEZE_AFTER, ExpertStats
from sits.sched.config import TenantPolicy

logger = logging.getLogger(__name__)

_STARTUP_POLL_S = 0.1
_STOP_TIMEOUT_S = 5.0
_STARTUP_EXIT_S = 2.0  # a child that reported a startup error exits by itself in this time


class AsyncMPLLM(RequestFrontEnd):
    """Asynchronous engine front end with the engine in a child process (see module docstring).

    Args:
        config: engine configuration.
        health_timeout_s: unhealthy when, between steps, the child has neither sent anything
            (outputs, stats or its idle heartbeat) nor turned its loop for this many seconds
            (`hung_loop_error`).
        step_timeout_s: ... or when one step has run this many seconds (a hung step; a long
            one, such as a big prompt chunk on a CPU, stays healthy until then).
        tenant_policies: the scheduler's tenants (`sits.engine.builder.tenant_policies_of`).
        expert_freeze_after: as `AsyncLLM`.
        restore_frozen_experts: as `AsyncLLM`.

    Raises:
        SitsError (ModelNotFoundError, UnsupportedModelError, InvalidParameterError, ...): the
            child failed to build the engine (same class and message as in the child).
        EngineDeadError: the child exited during startup without saying why.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        health_timeout_s: float = 10.0,
        step_timeout_s: float = ENGINE_STEP_TIMEOUT_S,
        tenant_policies: tuple[TenantPolicy, ...] = (),
        expert_freeze_after: int = DEFAULT_FREEZE_AFTER,
        restore_frozen_experts: bool = False,
    ) -> None:
        self.config = config
        self.model_name = config.model_name
        self.health_timeout_s = health_timeout_s
        self.step_timeout_s = step_timeout_s
        self.errored = False
        self.dead_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        ctx = multiprocessing.get_context("spawn")
        cmd_reader, self._cmd_conn = ctx.Pipe(duplex=False)
        self._out_conn, out_writer = ctx.Pipe(duplex=False)
        # The child's loop times, shared: (step start or 0 between steps, last loop turn).
        self._loop_times = ctx.Array("d", 2)
        self._proc = ctx.Process(
            target=run_engine_proc,
            args=(
                cmd_reader,
                out_writer,
                self._loop_times,
                config,
                tuple(tenant_policies),
                expert_freeze_after,
                restore_frozen_experts,
                logging.getLogger("sits").getEffectiveLevel(),
            ),
            name="sits-engine-core",
            daemon=True,
        )
        self._proc.start()
        cmd_reader.close()  # the child holds these ends now: EOF on either side = peer gone
        out_writer.close()
        try:
            self.info, self._stats = self._wait_ready()
            self.tokenizer = _load_tokenizer(config)
        except BaseException:
            self._stop_process(_STARTUP_EXIT_S)  # after a startup error the child exits itself
            raise
        self.max_model_len = self.info.max_model_len
        self._processor = OutputProcessor(self.tokenizer)
        self._delivery = BatchedDelivery()
        self._heartbeat_s = time.monotonic()
        self._writer = threading.Thread(target=self._write_loop, name="sits-engine-writer")
        self._writer.daemon = True
        self._writer.start()
        self._reader = threading.Thread(target=self._read_loop, name="sits-engine-reader")
        self._reader.daemon = True
        self._reader.start()

    # ---- public API (generate / abort: `RequestFrontEnd`) --------------------------------

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    def is_healthy(self) -> bool:
        """True while the engine process is alive and its loop keeps turning (a step within
        `step_timeout_s`); cheap, never blocks for long. A hung loop's reason becomes
        `dead_error`."""
        if self.errored or self._stopping or not self._reader.is_alive():
            return False
        with self._loop_times.get_lock():
            step_started_s, turned_s = self._loop_times[:]
        return self._loop_turning(max(self._heartbeat_s, turned_s), step_started_s or None)

    def stats(self) -> EngineStats:
        """The latest load snapshot the engine process sent."""
        return self._stats

    def set_borrowing_tiers(self, tiers: Iterable[str | Enum]) -> None:
        """As `AsyncLLM.set_borrowing_tiers` (applied by the child before its next step).

        Raises:
            ValueError: an unknown tier.
        """
        self._send(("borrowing", parse_tiers(tiers)))

    async def expert_stats(self) -> ExpertStats | None:
        """A fresh read of the MoE experts' counters (None for a dense model).

        Raises:
            EngineDeadError: the engine process is dead or hung.
        """
        return await self._call("expert_stats")

    async def freeze_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """As `AsyncLLM.freeze_expert` (same errors, rebuilt from the child's)."""
        return await self._call("freeze_expert", layer_id, expert_id)

    async def unfreeze_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """As `AsyncLLM.unfreeze_expert`."""
        return await self._call("unfreeze_expert", layer_id, expert_id)

    async def restore_expert(self, layer_id: int, expert_id: int) -> ExpertStats | None:
        """As `AsyncLLM.restore_expert`."""
        return await self._call("restore_expert", layer_id, expert_id)

    async def set_precision(self, name: str) -> PrecisionState:
        """As `AsyncLLM.set_precision` (same errors, rebuilt from the child's)."""
        return await self._call("set_precision", name, time.monotonic())

    def precision_state(self) -> PrecisionState:
        """As `AsyncLLM.precision_state`: from the latest stats the child sent (sent before
        each call's result, so a `set_precision` caller sees its switch)."""
        state = self._stats.precision
        assert state is not None, "every snapshot of a started engine carries it"
        return state

    async def prefill_chunks(self) -> list[PrefillChunk]:
        """As `AsyncLLM.prefill_chunks` (copied in the child between steps)."""
        return await self._call("prefill_chunks")

    def record_timeline(self, enabled: bool = True) -> None:
        """As `AsyncLLM.record_timeline`: chunk stamps in the child, detokenize time here."""
        self._send(("timeline", enabled))
        self._processor.time_detokenize = enabled

    async def shutdown(self) -> None:
        """Stop the engine process (terminated after a timeout); unfinished requests and
        pending calls get EngineDeadError."""
        self._stopping = True
        self._send(("stop",))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._stop_process, _STOP_TIMEOUT_S)
        dead = EngineDeadError("the engine was shut down")
        self._fail_all(dead)
        self._fail_calls(dead)

    # ---- asyncio side -------------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        """Queue a command for the writer thread (never blocks the caller)."""
        self._outbox.put(command)

    # ---- writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        """Send queued commands in order until None; a closed pipe ends it quietly (the child
        is gone: the reader thread fails everything in flight)."""
        while (command := self._outbox.get()) is not None:
            try:
                self._cmd_conn.send(command)
            except (OSError, ValueError):
                return

    async def _call(self, name: str, *args: object) -> Any:
        """Run the child's named call between steps and return (or raise) its result."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        self._loop = loop
        call_id = next(self._call_ids)
        future = loop.create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, name, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _resolve(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(unpack_error(value))

    def _fail_calls(self, error: BaseException) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    def _on_dead(self, error: BaseException) -> None:
        self._fail_all(error)
        self._fail_calls(error)

    # ---- reader thread ------------------------------------------------------------------

    def _read_loop(self) -> None:
        """Block on the child's pipe; hand each message on (the only reader of the pipe)."""
        try:
            while True:
                message = self._out_conn.recv()
                self._heartbeat_s = time.monotonic()
                self._dispatch(message)
        except (EOFError, OSError):
            pass  # the child exited (or shutdown closed the pipe)
        except BaseException:  # noqa: BLE001 - a bad message must still fail the requests
            logger.exception("engine reader thread failed")
        if self._stopping and self.dead_error is None:
            return
        self._proc.join(1.0)
        if self.dead_error is None:
            self.dead_error = EngineDeadError(
                f"the engine process exited (exit code {self._proc.exitcode})"
            )
        self.errored = True
        logger.error("engine process died: %s", self.dead_error)
        self._post(self._on_dead, EngineDeadError(f"the engine loop died: {self.dead_error!r}"))

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, stats = message
            self._take_stats(stats)
            if outputs:
                self._post(self._deliver, outputs)
        elif kind == "stats":
            self._take_stats(message[1])
        elif kind == "add_failed":
            self._post(self._fail_request, message[1], unpack_error(message[2]))
        elif kind == "result":
            _, call_id, ok, value = message
            self._post(self._resolve, call_id, ok, value)
        elif kind == "died":
            self.dead_error = unpack_error(message[1])

    def _take_stats(self, stats: EngineStats | None) -> None:
        """Keep `stats` unless it is older than the snapshot held: a step's message is written
        during the next step, after that step's commands' snapshot (`engine_proc`)."""
        if stats is not None and stats.time_s >= self._stats.time_s:
            self._stats = stats

    # ---- process ------------------------------------------------------------------------

    def _wait_ready(self) -> tuple[Any, EngineStats]:
        """Wait for the child's ("ready", info, stats); raise its startup error."""
        while not self._out_conn.poll(_STARTUP_POLL_S):
            if not self._proc.is_alive():
                if self._out_conn.poll(0):  # its last words may still be in the pipe
                    break
                raise EngineDeadError(
                    f"the engine process exited during startup (exit code {self._proc.exitcode})"
                )
        try:
            message = self._out_conn.recv()
        except EOFError:
            raise EngineDeadError("the engine process exited during startup") from None
        if message[0] == "startup_error":
            packed: PackedError = message[1]
            raise unpack_error(packed)
        assert message[0] == "ready", message[0]
        return message[1], message[2]

    def _stop_process(self, timeout_s: float) -> None:
        """Join the child for `timeout_s`, then terminate it (and kill it if it still lives)."""
        proc = self._proc
        proc.join(timeout_s)
        if proc.is_alive():
            logger.warning("engine process did not stop in %.1f s; terminating it", timeout_s)
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
        writer = self._writer
        if writer is not None:
            self._outbox.put(None)
            writer.join(2.0)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(2.0)
        for conn in (self._cmd_conn, self._out_conn):
            conn.close()


def _load_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer as `build_engine` loads it (None with `skip_tokenizer_init`)."""
    if config.skip_tokenizer_init:
        return None
    from sits.engine.tokenizer import Tokenizer
    from sits.models.loader import resolve_model_path

    return Tokenizer(resolve_model_path(config.tokenizer or config.model))
