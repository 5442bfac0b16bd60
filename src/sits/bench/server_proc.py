"""Start and stop a `sits serve` subprocess on loopback, for benchmarks that own their server.

The server runs as `python -m sits.cli.main serve --model M --host 127.0.0.1 --port P ...`
with the same interpreter (so the GPU machine's environment, carried wheels included, is the
server's too) and our environment minus $SITS_API_KEY, its output going to a log file.
`start()` returns once `GET /health` answers 200; `stop()` sends SIGTERM (the server drains
and exits 0) and kills it after a grace period.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from sits.bench.errors import BenchmarkError
from sits.config import API_KEY_ENV, child_process_env

_POLL_S = 0.2
_LOG_TAIL_CHARS = 3000


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: ours without $SITS_API_KEY, so the mode's flags alone decide
    auth (a key there would make the FCFS server refuse the tenants' keys, and `--tenants`
    refuse to start), and with the directory of the running `sits` package first on
    PYTHONPATH, so the server runs the same sits code as this driver (also from a checkout
    that is not installed)."""
    import sits

    env = {k: v for k, v in environ.items() if k != API_KEY_ENV}
    src = str(Path(sits.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def serve_command(model: str, port: int, serve_args: Sequence[str]) -> list[str]:
    """The `sits serve` command line for `model` on 127.0.0.1:`port` plus `serve_args`."""
    return [
        sys.executable, "-m", "sits.cli.main", "serve", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), *serve_args,
    ]  # fmt: skip


class SitsServer:
    """A `sits serve` subprocess (use as a context manager).

    Args:
        model: checkpoint directory or model id.
        serve_args: extra `sits serve` flags (e.g. `--tenants FILE --dtype bfloat16`).
        log_path: where the server's stdout and stderr go.
        startup_timeout_s: how long `start()` waits for /health.
        port: the port; None picks a free one.
    """

    def __init__(
        self,
        model: str,
        serve_args: Sequence[str],
        log_path: str | Path,
        startup_timeout_s: float = 900.0,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = serve_command(model, self.port, serve_args)
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    def log_tail(self) -> str:
        """The end of the server's log (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def start(self) -> SitsServer:
        """Start the server and wait until /health answers 200.

        Raises:
            BenchmarkError: the server exited or did not become healthy in time.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(child_process_env()),
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchmarkError(
                    f"`sits serve` exited with {self.proc.returncode} before becoming healthy; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise BenchmarkError(
                    f"`sits serve` not healthy after {self.startup_timeout_s:g} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(_POLL_S)

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM, wait up to `grace_s`, then kill; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.exit_code = self.proc.returncode
        return self.exit_code

    def __enter__(self) -> SitsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
