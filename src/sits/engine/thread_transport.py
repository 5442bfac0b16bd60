"""`ThreadTransport`: the engine loop in a thread of the front end's process.

The `EngineLoop` runs on one daemon thread. Commands reach it through a `queue.SimpleQueue`
(`CommandQueue`); its events are handed, on the engine thread, to the front end's callback,
which posts them to the asyncio loop with `call_soon_threadsafe`. The loop's times are plain
attributes (`LoopTimes`). The engine core stays reachable (`core`) for tests and benchmarks
that attach recorders to it. When the loop ends (stopped or dead) the core is shut down on
the engine thread (`EngineCore.shutdown`: tensor-parallel workers are joined). Invariant:
`on_closed` runs once, on the engine thread, after the loop's last event and that shutdown.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from sits.config import EngineConfig
from sits.engine.builder import build_engine
from sits.engine.engine_loop import EngineDriver, EngineLoop, LoopTimes
from sits.engine.messages import Command, Event, Stop
from sits.engine.stats import EngineStats
from sits.sched.config import TenantPolicy


class CommandQueue:
    """A `CommandSource` over a thread-safe queue (front end puts, engine thread reads)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._next: list[Command] = []  # a command `poll` took off the queue

    def put(self, command: Command) -> None:
        """Queue `command` (any thread; never blocks)."""
        self._queue.put(command)

    def poll(self, timeout_s: float) -> bool:
        """Whether a command is ready, waiting up to `timeout_s` (engine thread only)."""
        if self._next:
            return True
        try:
            self._next.append(
                self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
            )
        except queue.Empty:
            return False
        return True

    def recv(self) -> Command:
        """The next command (after `poll` returned True)."""
        return self._next.pop() if self._next else self._queue.get_nowait()


class _CallbackSink:
    """An `EventSink` that calls the front end's handler on the engine thread."""

    def __init__(self, on_event: Callable[[Event], None]) -> None:
        self.send = on_event


class ThreadTransport:
    """The engine in a thread (see the module docstring).

    Args:
        config: engine configuration.
        tenant_policies, expert_freeze_after, restore_frozen_experts: as `AsyncLLM`.

    Attributes:
        core: the engine core.
        info: the model's info.
        tokenizer: the model's tokenizer (None with `skip_tokenizer_init`).
        stats: the first stats snapshot.
        loop_times: the loop's times (`LoopTimes`).
        pid: None (no engine process).

    Raises:
        SitsError: building the engine failed (`build_engine`).
    """

    pid = None

    def __init__(
        self,
        config: EngineConfig,
        tenant_policies: tuple[TenantPolicy, ...],
        expert_freeze_after: int,
        restore_frozen_experts: bool,
    ) -> None:
        parts = build_engine(config, tenant_policies)
        self.core = parts.core
        self.info = parts.info
        self.tokenizer = parts.tokenizer
        self.loop_times = LoopTimes()
        try:
            self._driver = EngineDriver(
                parts.core, parts.info, config, expert_freeze_after, restore_frozen_experts
            )
        except BaseException:
            parts.core.shutdown()
            raise
        self.stats: EngineStats = self._driver.stats
        self._commands = CommandQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_event: Callable[[Event], None], on_closed: Callable[[str], None]) -> None:
        """Start the engine thread; `on_event(event)` gets each event there, and
        `on_closed(why)` runs after the loop ended."""
        loop = EngineLoop(self._driver, self._commands, _CallbackSink(on_event), self.loop_times)

        def run() -> None:
            try:
                loop.run()
            finally:
                self.core.shutdown()  # tensor-parallel workers end with the loop
            on_closed("the engine thread exited")

        self._thread = threading.Thread(target=run, name="sits-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        """Queue `command` for the loop (never blocks)."""
        self._commands.put(command)

    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float) -> None:
        """Ask the loop to stop and join its thread for up to `timeout_s` (blocking)."""
        self._commands.put(Stop())
        if self._thread is not None:
            self._thread.join(timeout_s)
