"""`ProcessTransport`: the engine loop in a "spawn" child process (`--engine-process`).

In a thread the engine loop runs Python (kernel launches) almost nonstop, so the HTTP event
loop waits for the GIL on every socket call. Here the `EngineLoop` runs in a child
(`run_engine_proc`, so CUDA initialises there too) with its own GIL. The messages of
`sits.engine.messages` travel pickled over two one-way pipes. In the parent, ONE writer
thread sends the commands, in order, from a queue the front end fills: a pipe holds 64 KiB
(about 16 adds of 512-token prompts) and the child reads it only between steps, so a send
from the event loop itself blocked every stream of the server until the step ended (measured
on the CPU under a flood: 18-46 s of loop lag). ONE reader thread blocks on the child's pipe
and hands each event to the front end's callback; when the pipe closes (the child exited,
killed or after its loop failed) it calls `on_closed` with the exit code. The loop's times
are a shared `multiprocessing.Array` (`SharedLoopTimes`).

Startup: the child builds the engine (without a tokenizer: the parent keeps it) and sends
`Ready` or `StartupError`; the constructor waits for it and raises the child's error with its
class and message. The child ignores SIGINT and SIGTERM (the parent owns shutdown: a Ctrl-C
or a SIGTERM to the whole process group, as `systemctl stop` sends, must not kill the engine
under the parent's draining requests) and exits when the parent's end of the command pipe
closes. `stop` asks it to stop and waits, up to its timeout, for the loop to end: the child
closes its event pipe then. What is left is the interpreter's teardown (with torch loaded,
2 s on an idle 2-core CPU, 12 s beside two busy processes), which gets its own ceiling,
`_EXIT_S`; a child past either wait is terminated, then killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from sits.config import EngineConfig
from sits.core.errors import EngineDeadError, SitsError
from sits.engine.builder import build_engine
from sits.engine.engine_loop import EngineDriver, EngineLoop, SharedLoopTimes
from sits.engine.messages import (
    Command,
    Event,
    Ready,
    StartupError,
    Stop,
    pack_error,
    unpack_error,
)
from sits.engine.stats import EngineStats
from sits.obs.gc_pauses import GcPauseMonitor, freeze_startup_heap
from sits.sched.config import TenantPolicy

logger = logging.getLogger(__name__)

_STARTUP_POLL_S = 0.1
_STARTUP_EXIT_S = 2.0  # a child that reported a startup error closes its pipe in this time
_EXIT_S = 60.0  # teardown of a child whose pipe closed; longer = a hang (killed)


def run_engine_proc(
    cmd_conn: Connection,
    out_conn: Connection,
    loop_times: Any,
    config: EngineConfig,
    tenant_policies: tuple[TenantPolicy, ...],
    expert_freeze_after: int,
    restore_frozen_experts: bool,
    log_level: int,
) -> None:
    """Child process entry: build the engine, send `Ready` or `StartupError`, then run the
    `EngineLoop` over the pipes until `Stop` or the parent goes away; exit code 1 when the
    loop died. `loop_times` is the shared `multiprocessing.Array("d", 3)` of
    `SharedLoopTimes`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    logging.getLogger("sits").setLevel(log_level)
    try:
        # The parent keeps the tokenizer; the child never detokenizes.
        parts = build_engine(dataclasses.replace(config, skip_tokenizer_init=True), tenant_policies)
        driver = EngineDriver(
            parts.core, parts.info, config, expert_freeze_after, restore_frozen_experts
        )
        loop = EngineLoop(driver, cmd_conn, out_conn, SharedLoopTimes(loop_times))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent's constructor
        if not isinstance(exc, SitsError):  # a user error is reported by the parent alone
            logger.exception("engine startup failed")
        with contextlib.suppress(OSError, ValueError):  # the parent is gone
            out_conn.send(StartupError(pack_error(exc)))
        out_conn.close()
        return
    frozen = freeze_startup_heap()  # the engine is built: none of it is garbage
    logger.info("froze %d startup objects out of garbage collection", frozen)
    pauses = GcPauseMonitor(where="engine").install()
    out_conn.send(Ready(parts.info, loop.stats))
    try:
        died = loop.run()
    finally:
        out_conn.close()  # the loop is over: the parent waits for the exit (`_EXIT_S`)
        pauses.close()
        gc.unfreeze()  # exit with a collectable heap (extensions report frozen objects as leaks)
    if died:
        raise SystemExit(1)


class ProcessTransport:
    """The engine in a child process (see the module docstring).

    Args:
        config: engine configuration.
        tenant_policies, expert_freeze_after, restore_frozen_experts: as `AsyncLLM`.

    Attributes:
        info: the model's info (from the child's `Ready`).
        tokenizer: the model's tokenizer, loaded here (None with `skip_tokenizer_init`).
        stats: the child's first stats snapshot.
        loop_times: the child's loop times (`SharedLoopTimes`).

    Raises:
        SitsError (ModelNotFoundError, UnsupportedModelError, InvalidParameterError, ...): the
            child failed to build the engine (same class and message as in the child).
        EngineDeadError: the child exited during startup without saying why.
    """

    def __init__(
        self,
        config: EngineConfig,
        tenant_policies: tuple[TenantPolicy, ...],
        expert_freeze_after: int,
        restore_frozen_experts: bool,
    ) -> None:
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reader: threading.Thread | None = None
        self._events_ended = threading.Event()  # the reader thread read EOF
        ctx = multiprocessing.get_context("spawn")
        cmd_reader, self._cmd_conn = ctx.Pipe(duplex=False)
        self._out_conn, out_writer = ctx.Pipe(duplex=False)
        array = ctx.Array("d", 3)
        self.loop_times = SharedLoopTimes(array)
        self._proc = ctx.Process(
            target=run_engine_proc,
            args=(
                cmd_reader,
                out_writer,
                array,
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
            self.info, self.stats = self._wait_ready()
            self.tokenizer = _load_tokenizer(config)
        except BaseException:
            self._stop_process(_STARTUP_EXIT_S)  # after a startup error the child exits itself
            raise

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code (None while it runs)."""
        return self._proc.exitcode

    def start(self, on_event: Callable[[Event], None], on_closed: Callable[[str], None]) -> None:
        """Start the writer and the reader thread: `on_event(event)` gets each event on the
        reader thread, `on_closed(why)` runs there once the child's pipe has closed."""
        self._writer = threading.Thread(target=self._write_loop, name="sits-engine-writer")
        self._writer.daemon = True
        self._writer.start()
        self._reader = threading.Thread(
            target=self._read_loop, args=(on_event, on_closed), name="sits-engine-reader"
        )
        self._reader.daemon = True
        self._reader.start()

    def send(self, command: Command) -> None:
        """Queue `command` for the writer thread (never blocks the caller)."""
        self._outbox.put(command)

    def alive(self) -> bool:
        """Whether the reader thread runs (the child's pipe is open)."""
        return self._reader is not None and self._reader.is_alive()

    def stop(self, timeout_s: float) -> None:
        """Ask the child to stop; join it for `timeout_s`, then terminate (and kill) it
        (blocking)."""
        self.send(Stop())
        self._stop_process(timeout_s)

    def _write_loop(self) -> None:
        """Send queued commands in order until None; a closed pipe ends it quietly (the child
        is gone: the reader thread reports it)."""
        while (command := self._outbox.get()) is not None:
            try:
                self._cmd_conn.send(command)
            except (OSError, ValueError):
                return

    def _read_loop(
        self, on_event: Callable[[Event], None], on_closed: Callable[[str], None]
    ) -> None:
        """Block on the child's pipe; hand each event on (the only reader of the pipe)."""
        try:
            while True:
                on_event(self._out_conn.recv())
        except (EOFError, OSError):
            pass  # the child closed its pipe (its loop ended, or it was killed)
        except BaseException:  # noqa: BLE001 - a bad event must still fail the requests
            logger.exception("engine reader thread failed")
        self._events_ended.set()
        self._proc.join(1.0)
        on_closed(f"the engine process exited (exit code {self._proc.exitcode})")

    def _wait_ready(self) -> tuple[Any, EngineStats]:
        """Wait for the child's `Ready`; raise its startup error."""
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
        if isinstance(message, StartupError):
            raise unpack_error(message.error)
        assert isinstance(message, Ready), message
        return message.info, message.stats

    def _stop_process(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the child to close its event pipe, then up to `_EXIT_S`
        for it to exit; terminate it (and kill it if it still lives) when a wait runs out."""
        proc = self._proc
        if self._events_closed(timeout_s):
            proc.join(_EXIT_S)
            if proc.is_alive():
                logger.warning("engine process did not exit in %.1f s; terminating it", _EXIT_S)
        elif proc.is_alive():
            logger.warning("engine process did not stop in %.1f s; terminating it", timeout_s)
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
        writer = self._writer
        if writer is not None:
            self._outbox.put(None)
            writer.join(2.0)
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(2.0)
        for conn in (self._cmd_conn, self._out_conn):
            conn.close()

    def _events_closed(self, timeout_s: float) -> bool:
        """Whether the child closed its event pipe (its loop or startup is over; a killed
        child's closes too) within `timeout_s`: the reader thread read EOF, or before `start`,
        the pipe reads EOF (anything still in it is dropped)."""
        if self._reader is not None:
            return self._events_ended.wait(timeout_s)
        deadline_s = time.monotonic() + timeout_s
        try:
            while self._out_conn.poll(max(0.0, deadline_s - time.monotonic())):
                self._out_conn.recv()
        except (EOFError, OSError):
            return True
        return False


def _load_tokenizer(config: EngineConfig) -> Any:
    """The model's tokenizer as `build_engine` loads it (None with `skip_tokenizer_init`)."""
    if config.skip_tokenizer_init:
        return None
    from sits.engine.tokenizer import Tokenizer
    from sits.models.loader import resolve_model_path

    if config.tokenizer:
        return Tokenizer(resolve_model_path(config.tokenizer, download_dir=config.download_dir))
    return Tokenizer(resolve_model_path(config.model, **config.hub_options))
