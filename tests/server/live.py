"""A live sits server for tests: uvicorn on 127.0.0.1 (a free port) in a background thread.

The engine is built inside the server's thread and event loop (as `sits serve` does), the app
by `build_app`, and uvicorn runs through sits' `DrainingServer`. Engine death is recorded in
`fatal_codes` instead of stopping the server, unless `exit_on_fatal` is set, so tests can
still probe /health afterwards.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import openai

from sits.server.app import build_app
from sits.server.context import ServerSettings
from sits.server.uvicorn_server import DrainingServer, make_server
from tests.waits import HANG_S, wait_until


class LiveServer:
    """Context manager serving `make_engine()` over HTTP on loopback.

    Args:
        make_engine: builds the engine (called in the server thread).
        settings: server settings.
        exit_on_fatal: let engine death stop the server (as in production).
        uvicorn_kwargs: further `uvicorn.Config` options (root_path, ssl_*).
    """

    def __init__(
        self,
        make_engine: Callable[[], Any],
        settings: ServerSettings | None = None,
        *,
        exit_on_fatal: bool = False,
        uvicorn_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.make_engine = make_engine
        self.settings = settings or ServerSettings()
        self.exit_on_fatal = exit_on_fatal
        self.uvicorn_kwargs = uvicorn_kwargs or {}
        self.fatal_codes: list[int] = []
        self.engine: Any = None
        self.server: DrainingServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.engine = self.make_engine()
            app = build_app(self.engine, self.settings)
            server = make_server(
                app, "127.0.0.1", self.port, log_level="warning", **self.uvicorn_kwargs
            )
            if not self.exit_on_fatal:
                server.lifecycle.on_fatal = self.fatal_codes.append
            self.server = server
            await server.serve(sockets=[self._sock])

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by start()/stop()
            self.error = exc

    def __enter__(self) -> LiveServer:
        self._thread.start()

        def started_or_failed() -> bool:
            failed = self.error is not None or not self._thread.is_alive()
            return failed or (self.server is not None and self.server.started)

        if not wait_until(started_or_failed):
            raise TimeoutError(f"server did not start in {HANG_S:.0f} s")
        if not (self.server is not None and self.server.started):
            raise RuntimeError(f"server failed to start: {self.error!r}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the server and wait for its shutdown (the engine's included) to end."""
        if self.server is not None:
            self.server.should_exit = True
        self._thread.join(HANG_S)
        if self._thread.is_alive():
            raise TimeoutError(f"server did not stop in {HANG_S:.0f} s")

    @property
    def lifecycle(self) -> Any:
        assert self.server is not None
        return self.server.lifecycle

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        """The official OpenAI client pointed at this server (no retries)."""
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **kwargs
        )

    def http(self, **kwargs: Any) -> httpx.Client:
        """A plain HTTP client for raw requests."""
        kwargs.setdefault("timeout", HANG_S)
        return httpx.Client(base_url=self.base_url, **kwargs)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the server's loop; returns a concurrent.futures.Future."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def wait_until(self, predicate: Callable[[], bool], timeout_s: float = HANG_S) -> bool:
        """Poll `predicate` every 10 ms for up to `timeout_s`; returns its last value."""
        return wait_until(predicate, timeout_s)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels without model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def free_port() -> int:
    """A loopback port that was free a moment ago (for subprocess servers)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base_url: str) -> None:
    """Wait until the server process `proc` answers 200 on `base_url`/health (its model
    loaded), up to `HANG_S`.

    Raises:
        AssertionError: the process exited first.
        TimeoutError: it never answered.
    """

    def healthy() -> bool:
        assert proc.poll() is None, f"the server exited during startup ({proc.returncode})"
        try:
            return httpx.get(f"{base_url}/health", timeout=HANG_S).status_code == 200
        except httpx.TransportError:
            return False

    if not wait_until(healthy):
        raise TimeoutError(f"the server did not become healthy in {HANG_S:.0f} s")
