"""SIGTERM on a real `sits serve` process with live streams: drain, 503s with Retry-After,
exit 0; a second SIGTERM cuts the streams with their error event and exits 1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import types
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from sits.server.uvicorn_server import DrainingServer
from tests.server.live import free_port, wait_healthy
from tests.waits import HANG_S, wait_until

PROMPT = "def fibonacci(n):"


class ServeProcess:
    """`python -m sits.cli.main serve ...` on a free loopback port."""

    def __init__(self, model_dir: Path, shutdown_timeout_s: float, log_path: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "sits.cli.main", "serve",
            "--model", str(model_dir),
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(16 << 20),
            "--shutdown-timeout", str(shutdown_timeout_s),
            "--log-level", "warning",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SITS_API_KEY": ""}
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def serve_factory(tiny_moe_dir, tmp_path):
    started: list[ServeProcess] = []

    def start(shutdown_timeout_s: float) -> ServeProcess:
        process = ServeProcess(
            tiny_moe_dir, shutdown_timeout_s, tmp_path / f"serve{len(started)}.log"
        )
        started.append(process)
        wait_healthy(process.proc, process.base_url)
        return process

    yield start
    for process in started:
        process.stop()


class _Stream(threading.Thread):
    """A streamed completion read in a thread; `first` is set once its first event came."""

    def __init__(self, base_url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.base_url, self.body = base_url, body
        self.first = threading.Event()
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(base_url=self.base_url, timeout=HANG_S) as http,
                http.stream("POST", "/v1/completions", json=self.body) as resp,
            ):
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc
            self.first.set()


def _start_streams(base_url: str, body: dict, count: int) -> list[_Stream]:
    streams = [_Stream(base_url, body) for _ in range(count)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first.wait(HANG_S) and stream.error is None
    return streams


def _refused_while_draining(base_url: str) -> None:
    def draining() -> bool:
        return httpx.get(f"{base_url}/health", timeout=HANG_S).status_code == 503

    assert wait_until(draining), "health never turned 503 after SIGTERM"
    resp = httpx.post(
        f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=HANG_S
    )
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "draining"
    assert resp.headers["retry-after"] == "1"  # a client or gateway retries elsewhere soon


DRAIN_BODY = {  # ends well inside a long drain
    "prompt": PROMPT,
    "max_tokens": 150,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
LONG_BODY = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}


def drain_live_streams(server, sig: int) -> list[_Stream]:
    """Three DRAIN_BODY streams, then `sig`: the server refuses new work while it drains;
    returns the streams once they ended."""
    streams = _start_streams(server.base_url, DRAIN_BODY, 3)
    server.proc.send_signal(sig)
    _refused_while_draining(server.base_url)
    for stream in streams:
        stream.join(HANG_S)
    return streams


def cut_live_streams(server, sig: int) -> list[_Stream]:
    """Two LONG_BODY streams, `sig` (a drain that would wait), then `sig` again; returns the
    streams once they ended."""
    streams = _start_streams(server.base_url, LONG_BODY, 2)
    server.proc.send_signal(sig)
    _refused_while_draining(server.base_url)
    server.proc.send_signal(sig)
    for stream in streams:
        stream.join(HANG_S)
    return streams


def assert_completed(streams: list[_Stream]) -> None:
    """Every stream ended normally with its 150 tokens."""
    for stream in streams:
        assert stream.error is None
        assert stream.events[-1] == "[DONE]"
        assert json.loads(stream.events[-2])["usage"]["completion_tokens"] == 150


def assert_cut(streams: list[_Stream]) -> None:
    """Every stream ended with the draining error event, then [DONE]."""
    for stream in streams:
        assert stream.error is None
        assert stream.events[-1] == "[DONE]"
        assert json.loads(stream.events[-2])["error"]["code"] == "draining"


def test_sigterm_drains_live_streams_then_exits_0(serve_factory) -> None:
    server = serve_factory(shutdown_timeout_s=HANG_S)  # the streams end well before
    assert_completed(drain_live_streams(server, signal.SIGTERM))
    assert server.proc.wait(HANG_S) == 0


def test_sigterm_cuts_streams_after_the_timeout(serve_factory) -> None:
    server = serve_factory(shutdown_timeout_s=0.5)
    (stream,) = _start_streams(server.base_url, LONG_BODY, 1)
    server.proc.send_signal(signal.SIGTERM)
    stream.join(HANG_S)
    assert stream.error is None
    assert stream.events[-1] == "[DONE]"
    error = json.loads(stream.events[-2])["error"]
    assert error["code"] == "draining" and error["type"] == "service_unavailable_error"
    assert server.proc.wait(HANG_S) == 0


def test_a_second_sigterm_cuts_streams_with_their_error_event_and_exits_1(serve_factory) -> None:
    """The trial: a second SIGTERM closed streams without an error event and exited 0. It now
    fails every open stream with the draining error (then [DONE]) and exits 1."""
    server = serve_factory(shutdown_timeout_s=HANG_S)  # the drain alone would wait
    assert_cut(cut_live_streams(server, signal.SIGTERM))
    assert server.proc.wait(HANG_S) == 1


def test_the_default_drain_ends_inside_a_30_s_kill_grace_period() -> None:
    from sits.cli.main import build_parser
    from sits.server.context import _CUT_STREAMS_FLUSH_S
    from sits.server.uvicorn_server import _GRACEFUL_CLOSE_S

    args = build_parser().parse_args(["serve"])
    assert args.shutdown_timeout + _CUT_STREAMS_FLUSH_S + _GRACEFUL_CLOSE_S < 30


def test_a_signal_after_the_engines_death_is_noted_then_a_second_one_forces() -> None:
    """The server stops by itself after the engine died (exit code 1): a supervisor's SIGTERM
    meanwhile must not force-cancel uvicorn's bounded shutdown; a second signal still does."""
    lifecycle = types.SimpleNamespace(on_fatal=None)
    server = DrainingServer(uvicorn.Config(FastAPI()), lifecycle)  # type: ignore[arg-type]
    assert lifecycle.on_fatal == server.fatal
    server.fatal(1)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert not server.force_exit and server.exit_code == 1
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit and server.exit_code == 1


def test_a_third_signal_stops_without_waiting_for_the_cut() -> None:
    """First signal: drain; second: cut the open requests (exit 1, uvicorn's own bounded
    shutdown, so the lifespan ends cleanly); third: uvicorn's force_exit."""
    lifecycle = types.SimpleNamespace(on_fatal=None)
    server = DrainingServer(uvicorn.Config(FastAPI()), lifecycle)  # type: ignore[arg-type]
    scheduled: list = []
    server._loop = types.SimpleNamespace(call_soon_threadsafe=scheduled.append)
    server.handle_exit(signal.SIGTERM, None)
    assert scheduled == [server.start_drain] and server.exit_code == 0
    server._drain_task = object()  # the drain runs
    server.handle_exit(signal.SIGTERM, None)
    assert scheduled[-1] == server._start_force and server.exit_code == 1
    assert not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit and server.should_exit and server.exit_code == 1
