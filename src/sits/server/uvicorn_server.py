"""Running an app under uvicorn with sits' shutdown rules.

- The first SIGTERM (or SIGINT) starts a drain instead of uvicorn's immediate stop: the
  listening socket stays open so new requests get a 503 (with Retry-After) rather than a
  refused connection, admitted requests finish for up to `shutdown_timeout_s`, open streams
  are then cut with a final error event, and the process exits 0. A second signal stops at
  once, not cleanly: every open stream still gets its error event (up to
  `_CUT_STREAMS_FLUSH_S` to write them), and the process exits `FORCED_EXIT_CODE` (1), so a
  supervisor knows requests were cut short; a third signal stops without waiting. The
  default drain (20 s of `--shutdown-timeout`, 2 s to flush cut streams, 5 s for uvicorn to
  close connections) ends inside the usual 30 s between SIGTERM and SIGKILL (Kubernetes'
  default terminationGracePeriodSeconds).
- When the engine dies, the lifecycle calls `fatal(code)`: open requests have already been
  failed, uvicorn stops, and `run_app` returns the non-zero code so a supervisor restarts the
  process; the first signal that arrives meanwhile is only noted, a second one stops at once.
- The HTTP protocol and the event loop are uvicorn's `--http` and `--loop` choices, resolved
  by `sits.server.http_impl`: "auto" takes httptools and uvloop when installed (`pip install
  httptools uvloop`, as uvicorn[standard] does), else h11 and asyncio's own loop. The HTTP
  process handles every streamed token, so its cost per event bounds TTFT and ITL under load.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from sits.obs.gc_pauses import freeze_startup_heap
from sits.server.context import ServerLifecycle
from sits.server.http_impl import loop_factory, resolve_http

logger = logging.getLogger(__name__)

# After the drain, uvicorn waits this long for connections to finish before cancelling them.
_GRACEFUL_CLOSE_S = 5.0
FORCED_EXIT_CODE = 1  # a second signal cut the drain short


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the lifecycle before stopping.

    Attributes:
        exit_code: 0 after a drain (clean or cut), the engine-death code after `fatal`,
            FORCED_EXIT_CODE after a second signal.
        drained_cleanly: None until a drain ends, then whether nothing had to be cut.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.exit_code = 0
        self.drained_cleanly: bool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._noted_stop_signal = False
        self._cutting = False  # a second signal is cutting the open requests
        lifecycle.on_fatal = self.fatal

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then tell the lifecycle the server listens (and on which port):
        the fleet registration waits for it before its first post."""
        await super().startup(sockets=sockets)
        if not self.started:
            return
        self.lifecycle.bound_port = _bound_port(self.servers)
        self.lifecycle.listening.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler: the first signal drains, a second one stops at once. After the
        engine's death the server is stopping already: the first signal is only noted (a
        supervisor's SIGTERM then does not cut uvicorn's bounded shutdown short)."""
        if self._cutting:  # a third signal: stop without waiting
            self.force_exit = True
            self.should_exit = True
            return
        if self.exit_code != 0 and not self._noted_stop_signal:
            self._noted_stop_signal = True
            logger.info("signal %s: already stopping (the engine died)", signal.Signals(sig).name)
            return
        if self._drain_task is not None or self.should_exit or self._loop is None:
            logger.warning("second signal %s: cutting open requests and stopping", sig)
            if self._loop is None or self.exit_code != 0:
                self.force_exit = True  # nothing to cut: the engine's death failed them
                self.should_exit = True
                return
            self.exit_code = FORCED_EXIT_CODE
            self._cutting = True
            self._loop.call_soon_threadsafe(self._start_force)
            return
        logger.info("signal %s: draining before exit", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self.start_drain)

    def start_drain(self) -> None:
        """Begin the drain (on the event loop); idempotent."""
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            self.drained_cleanly = await self.lifecycle.drain()
        finally:
            self.should_exit = True

    def _start_force(self) -> None:
        """The second signal, on the event loop: cut every open request with its error
        event, give the streams a moment to write it, then stop without waiting."""
        asyncio.ensure_future(self._force())

    async def _force(self) -> None:
        """Not uvicorn's force_exit: that cancels the app's lifespan shutdown mid-way (a
        CancelledError traceback in the log); the streams are cut already, so uvicorn's own
        bounded shutdown is quick. A third signal forces."""
        try:
            self.drained_cleanly = False
            await self.lifecycle.cut_open_requests()
        finally:
            self.should_exit = True

    def fatal(self, exit_code: int) -> None:
        """Stop serving and make `run_app` return `exit_code` (engine death)."""
        self.exit_code = exit_code
        self.should_exit = True


def _bound_port(servers: list[asyncio.Server]) -> int | None:
    """The TCP port of the first IP socket of uvicorn's servers (None: none, e.g. a Unix
    socket)."""
    for server in servers:
        for sock in server.sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                return int(sock.getsockname()[1])
    return None


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines of successful `/health` probes (a load balancer or the fleet
    router probes every second; a failing probe is still logged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 5 and args[2] == "/health":
            return args[4] != 200
        return True


def make_server(
    app: FastAPI, host: str, port: int, log_level: str = "info", **uvicorn_kwargs: object
) -> DrainingServer:
    """A DrainingServer for `app` (whose lifecycle is `app.state.ctx.lifecycle`)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(_GRACEFUL_CLOSE_S),
        lifespan="on",
        **uvicorn_kwargs,  # type: ignore[arg-type]
    )
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietProbes) for f in access.filters):
        access.addFilter(QuietProbes())
    return DrainingServer(config, app.state.ctx.lifecycle)


def run_app(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str = "info",
    http: str = "auto",
    loop: str = "auto",
    **uvicorn_kwargs: object,
) -> int:
    """Serve `app` until drained or the engine dies.

    Args:
        app, host, port, log_level: what uvicorn serves, where, and its log level.
        http: the HTTP protocol (`resolve_http`).
        loop: the event loop (`loop_factory`).
        uvicorn_kwargs: further `uvicorn.Config` options (root_path; ssl_keyfile,
            ssl_certfile, ssl_ca_certs, ssl_cert_reqs: HTTPS).

    Returns:
        The process exit code: 0 after a signal-initiated drain, non-zero after engine death.

    Raises:
        InvalidParameterError: `http` or `loop` names an unknown or missing implementation.
    """
    factory = loop_factory(loop)
    server = make_server(app, host, port, log_level, http=resolve_http(http), **uvicorn_kwargs)
    logger.info(
        "HTTP: %s on %s", server.config.http, "uvloop" if factory else "asyncio's event loop"
    )
    frozen = freeze_startup_heap()  # the engine and app are built: none of it is garbage
    logger.info("froze %d startup objects out of garbage collection", frozen)
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(server.serve())
    finally:
        gc.unfreeze()  # exit with a collectable heap (extensions report frozen objects as leaks)
    if server.drained_cleanly is False:
        logger.warning("drain timed out: open requests were cut")
    return server.exit_code
