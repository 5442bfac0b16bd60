"""Server lifecycle: admission while serving, drain on SIGTERM, reaction to engine death.

States: serving -> draining (SIGTERM) -> stopped, or serving -> engine dead (loop died/hung).

Invariants:
- While draining or once the engine is unhealthy, `admit()` raises 503 at once: new requests
  never wait on an engine that will not serve them.
- `drain()` sets `drain_started` at once (the fleet registration deregisters on it, a hung
  injected fault answers on it), lets admitted requests finish for up to
  `shutdown_timeout_s`, then fails the jobs still open with a 503 error (streams end with an
  error event) and returns whether the drain was clean (nothing cut).
- The monitor polls `engine.is_healthy()`; when it turns False every open job fails at once
  with `EngineDeadError` and `on_fatal(exit_code)` asks the process to exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sits.core.errors import EngineDeadError
from sits.server.engine_client import EngineClient
from sits.server.errors import ServerError, unavailable
from sits.server.jobs import GenerationJob

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 1
_CUT_STREAMS_FLUSH_S = 2.0


def draining_error() -> ServerError:
    """503 for requests that arrive (or are cut) while the server shuts down."""
    return unavailable("The server is shutting down; retry on another replica.", "draining")


class Ticket:
    """One admitted HTTP request; `release()` (idempotent) ends it for the drain's count."""

    def __init__(self, lifecycle: ServerLifecycle) -> None:
        self._lifecycle = lifecycle
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._lifecycle._release()


class ServerLifecycle:
    """Tracks admitted requests and open jobs; drains; watches the engine's health.

    Args:
        engine: the engine front end.
        shutdown_timeout_s: how long a drain waits for admitted requests.
        health_poll_s: how often the monitor calls `engine.is_healthy()`.
        on_fatal: called once with an exit code when the engine dies (the CLI stops the
            process); None to only fail requests and report unhealthy.
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        shutdown_timeout_s: float = 30.0,
        health_poll_s: float = 0.2,
        on_fatal: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.health_poll_s = health_poll_s
        self.on_fatal = on_fatal
        self.draining = False
        self.cut = False  # the drain timed out: jobs registered from now on fail at once
        self.engine_dead = False
        self.num_admitted = 0
        self._jobs: set[GenerationJob] = set()
        self.drain_started = asyncio.Event()  # set by the first `drain()`
        # Set by `sits.server.uvicorn_server.DrainingServer` once its sockets accept
        # connections, with the port bound (useful with port 0); never set for an app served
        # otherwise.
        self.listening = asyncio.Event()
        self.bound_port: int | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._monitor: asyncio.Task[None] | None = None

    # --- serving ---------------------------------------------------------------------------
    def healthy(self) -> bool:
        """True while the engine loop is alive and stepping (never blocks)."""
        if self.engine_dead:
            return False
        try:
            return bool(self.engine.is_healthy())
        except Exception:  # noqa: BLE001 - a failing health probe means unhealthy
            return False

    def admit(self) -> Ticket:
        """Admit one request.

        Raises:
            ServerError: 503 while draining or when the engine is not healthy.
        """
        if self.draining:
            raise draining_error()
        if not self.healthy():
            raise unavailable("The engine is not running; retry on another replica.", "engine_dead")
        self.num_admitted += 1
        self._idle.clear()
        return Ticket(self)

    def _release(self) -> None:
        self.num_admitted -= 1
        assert self.num_admitted >= 0
        if self.num_admitted == 0:
            self._idle.set()

    def add_job(self, job: GenerationJob) -> None:
        """Register an open job so a drain timeout or engine death can fail it."""
        if self.engine_dead:
            raise EngineDeadError(str(self.engine.dead_error or "the engine loop stopped"))
        if self.cut:
            raise draining_error()
        self._jobs.add(job)

    def remove_job(self, job: GenerationJob) -> None:
        self._jobs.discard(job)

    # --- engine health ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the health monitor (call from the running event loop)."""
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(self.health_poll_s)
            if not self.healthy():
                self.mark_engine_dead()
                return

    def mark_engine_dead(self) -> None:
        """Fail every open job with EngineDeadError and ask the process to exit non-zero."""
        if self.engine_dead:
            return
        self.engine_dead = True
        cause = self.engine.dead_error
        message = f"the engine loop stopped ({cause!r})" if cause else "the engine loop stopped"
        logger.error(
            "engine is unhealthy: %s; failing %d open request(s)", message, len(self._jobs)
        )
        for job in list(self._jobs):
            job.fail(EngineDeadError(message))
        if self.on_fatal is not None:
            self.on_fatal(ENGINE_DEAD_EXIT_CODE)

    # --- shutdown --------------------------------------------------------------------------
    async def drain(self) -> bool:
        """Refuse new requests, let admitted ones finish, then cut what is left.

        Returns:
            True when every admitted request finished within `shutdown_timeout_s`.
        """
        self.draining = True
        self.drain_started.set()
        logger.info(
            "draining: %d request(s) in flight, waiting up to %.1f s",
            self.num_admitted,
            self.shutdown_timeout_s,
        )
        try:
            await asyncio.wait_for(self._idle.wait(), self.shutdown_timeout_s)
            return True
        except TimeoutError:
            pass
        logger.warning("drain timeout: cutting %d open request(s)", len(self._jobs))
        self.cut = True
        for job in list(self._jobs):
            job.fail(draining_error())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _CUT_STREAMS_FLUSH_S)
        return False

    async def stop(self) -> None:
        """Stop the health monitor."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
