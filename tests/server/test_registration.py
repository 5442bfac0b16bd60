"""Fleet registration (`sits serve --register-with`): the heartbeat messages, the register ->
heartbeat -> deregister sequence, outages logged once, the CLI flags, and real servers (in
process and a `sits serve` process) against a fake router."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sits.cli.fleet_flags import registration_arg, resolve_router_key
from sits.cli.serve import add_serve_parser, run_serve
from sits.core.errors import InvalidParameterError
from sits.core.fleet import DEREGISTER_PATH, HEARTBEAT_PATH, REGISTER_PATH, Heartbeat
from sits.obs.timeline import RequestTimeline, TimelineBuffer
from sits.server.context import ServerLifecycle, ServerSettings
from sits.server.registration import FleetRegistration, RegistrationSettings
from tests.server.live import LiveServer, free_port
from tests.waits import HANG_S

ROUTER_KEY = "router-secret"
PROMPT = "def fibonacci(n):"
_WAIT_S = HANG_S


def _sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run an async test function with asyncio.run (the tests' own loop)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return run


class _Engine:
    """What the registration reads of an engine (`num_health_checks` counts the loop's turns)."""

    model_name = "tiny"
    max_model_len = 1024
    dead_error = None

    def __init__(self) -> None:
        self.config = SimpleNamespace(max_num_seqs=8)
        self.snapshot: Any = SimpleNamespace(num_running=3, num_waiting=2, kv_cache_usage=0.25)
        self.healthy = True
        self.num_health_checks = 0

    def is_healthy(self) -> bool:
        self.num_health_checks += 1
        return self.healthy

    def stats(self) -> Any:
        if isinstance(self.snapshot, Exception):
            raise self.snapshot
        return self.snapshot


def _timeline(request_id: str, finished_s: float, ttft_s: float, tpot_s: float, **kw: Any):
    values: dict[str, Any] = dict(
        request_id=request_id,
        tenant_id="default",
        num_samples=1,
        arrival_s=finished_s - 5.0,
        first_scheduled_s=finished_s - 5.0,
        first_token_s=finished_s - 5.0 + ttft_s,
        last_token_s=finished_s,
        finished_s=finished_s,
        num_prompt_tokens=4,
        num_cached_tokens=0,
        num_output_tokens=10,
        tpot_s=tpot_s,
        finish_reason="length",
    )
    values.update(kw)
    return RequestTimeline(**values)


def _registration(
    engine: _Engine,
    transport: httpx.AsyncBaseTransport | None = None,
    timelines: TimelineBuffer | None = None,
    **settings: Any,
) -> tuple[FleetRegistration, ServerLifecycle]:
    lifecycle = ServerLifecycle(engine)  # type: ignore[arg-type]
    values: dict[str, Any] = dict(
        router_url="http://router:8000/", advertise_url="http://replica:8001/"
    )
    values.update(settings)
    registration = FleetRegistration(
        RegistrationSettings(**values),
        ROUTER_KEY,
        engine=engine,  # type: ignore[arg-type]
        lifecycle=lifecycle,
        model_name="tiny",
        overload_state=lambda: "yellow",
        timelines=timelines or TimelineBuffer(),
        transport=transport,
        now=lambda: 1000.0,
    )
    return registration, lifecycle


def test_the_heartbeat_carries_the_engines_load_and_the_recent_latencies() -> None:
    ring = TimelineBuffer()
    ring.add(_timeline("old", finished_s=900.0, ttft_s=9.0, tpot_s=9.0))  # outside 60 s
    for i, (ttft, tpot) in enumerate([(0.1, 0.01), (0.3, 0.03), (0.2, 0.02)]):
        ring.add(_timeline(f"r{i}", finished_s=950.0 + i, ttft_s=ttft, tpot_s=tpot))
    ring.add(_timeline("gone", finished_s=999.0, ttft_s=5.0, tpot_s=5.0, finish_reason="abort"))
    engine = _Engine()
    registration, lifecycle = _registration(engine, timelines=ring, version_label="canary")
    hb = registration.heartbeat()
    assert (hb.url, hb.models, hb.version_label) == ("http://replica:8001", ("tiny",), "canary")
    assert (hb.capacity, hb.max_model_len) == (8, 1024)
    load = hb.load
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (3, 2, 0.25)
    assert (load.overload_state, load.draining) == ("yellow", False)
    assert (load.ttft_p50_s, load.ttft_p99_s) == pytest.approx((0.2, 0.3))
    assert (load.tpot_p50_s, load.tpot_p99_s) == pytest.approx((0.02, 0.03))
    assert Heartbeat.from_json(hb.to_json()) == hb
    lifecycle.draining = True
    engine.snapshot = RuntimeError("engine gone")  # a failing engine reads as no load
    empty, _ = _registration(engine)
    load = empty.heartbeat().load
    assert (load.num_running, load.num_waiting, load.kv_cache_usage) == (0, 0, 0.0)
    assert load.ttft_p50_s is None and load.tpot_p99_s is None
    assert registration.heartbeat().load.draining is True
    engine.snapshot = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=1.0000001)
    assert registration.heartbeat().load.kv_cache_usage == 1.0  # clamped into [0, 1]


def test_the_default_url_takes_the_bound_port() -> None:
    engine = _Engine()
    registration, lifecycle = _registration(engine, advertise_url=None, advertise_host="::1")
    assert registration.url is None
    lifecycle.bound_port = 40123
    assert registration.url == "http://[::1]:40123"
    v4, lifecycle = _registration(engine, advertise_url=None, advertise_host="10.0.0.5")
    lifecycle.bound_port = 8001
    assert v4.url == "http://10.0.0.5:8001" and v4.heartbeat().url == "http://10.0.0.5:8001"


@pytest.mark.parametrize(
    ("field", "value"),
    [("router_url", "router:8000"), ("advertise_url", "ftp://x"), ("advertise_url", "http://"),
     ("version_label", ""), ("version_label", "a b"), ("heartbeat_interval_s", 0.0),
     ("request_timeout_s", float("nan")), ("latency_window_s", -1.0)],
)  # fmt: skip
def test_bad_registration_settings_are_refused(field: str, value: Any) -> None:
    values: dict[str, Any] = dict(router_url="http://r", advertise_url="http://a")
    values[field] = value
    with pytest.raises(InvalidParameterError) as err:
        RegistrationSettings(**values)
    assert err.value.param == field


def test_registration_needs_the_router_key_in_the_settings() -> None:
    with pytest.raises(InvalidParameterError) as err:
        ServerSettings(registration=RegistrationSettings("http://r", "http://a"))
    assert err.value.param == "router_key"


class _Recorder:
    """An httpx MockTransport handler recording the posts; `answer(n, request)` decides the
    n-th post's answer (0-based) or raises."""

    def __init__(self, answer: Callable[[int, httpx.Request], httpx.Response]) -> None:
        self.answer = answer
        self.posts: list[tuple[str, str | None, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        import json

        self.posts.append(
            (request.url.path, request.headers.get("authorization"), json.loads(request.content))
        )
        return self.answer(len(self.posts) - 1, request)

    @property
    def paths(self) -> list[str]:
        return [path for path, _, _ in self.posts]


@_sync
async def test_register_then_heartbeats_then_one_deregister_on_drain() -> None:
    engine = _Engine()
    lifecycle_box: list[ServerLifecycle] = []

    def answer(n: int, request: httpx.Request) -> httpx.Response:
        if n == 2:  # the second heartbeat: SIGTERM arrives
            asyncio.ensure_future(lifecycle_box[0].drain())
        return httpx.Response(200, json={"ok": True})

    recorder = _Recorder(answer)
    registration, lifecycle = _registration(
        engine, httpx.MockTransport(recorder), heartbeat_interval_s=0.001
    )
    lifecycle_box.append(lifecycle)
    registration.start()
    await asyncio.sleep(0)  # the task waits for the server to listen: nothing posted yet
    assert recorder.posts == []
    lifecycle.listening.set()
    await asyncio.wait_for(registration._task, _WAIT_S)  # type: ignore[arg-type]
    assert recorder.paths == [REGISTER_PATH, HEARTBEAT_PATH, HEARTBEAT_PATH, DEREGISTER_PATH]
    assert {auth for _, auth, _ in recorder.posts} == {f"Bearer {ROUTER_KEY}"}
    register = Heartbeat.from_json(recorder.posts[0][2])
    assert register.url == "http://replica:8001" and register.models == ("tiny",)
    assert register.capacity == 8 and register.load.num_waiting == 2
    assert recorder.posts[3][2] == {"url": "http://replica:8001"}
    assert registration.registered and registration.deregistered
    await registration.stop()  # no second deregister
    assert recorder.paths[-1] == DEREGISTER_PATH and len(recorder.posts) == 4


@_sync
async def test_an_outage_is_logged_once_retried_and_never_fatal(caplog) -> None:
    engine = _Engine()
    box: list[ServerLifecycle] = []

    def answer(n: int, request: httpx.Request) -> httpx.Response:
        if n < 3:
            raise httpx.ConnectError("connection refused", request=request)
        if n in (5, 6):  # a second outage: the router refuses the key
            return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
        if n == 8:
            asyncio.ensure_future(box[0].drain())
        return httpx.Response(200)

    recorder = _Recorder(answer)
    registration, lifecycle = _registration(
        engine, httpx.MockTransport(recorder), heartbeat_interval_s=0.001
    )
    box.append(lifecycle)
    lifecycle.listening.set()
    caplog.set_level(logging.INFO, logger="sits.server.registration")
    registration.start()
    await asyncio.wait_for(registration._task, _WAIT_S)  # type: ignore[arg-type]
    # Registering is retried until accepted (post 3), then the heartbeats follow.
    assert recorder.paths == [REGISTER_PATH] * 4 + [HEARTBEAT_PATH] * 5 + [DEREGISTER_PATH]
    assert registration.num_failures == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "ConnectError" in warnings[0] and REGISTER_PATH in warnings[0]
    assert "HTTP 401" in warnings[1] and HEARTBEAT_PATH in warnings[1]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("answers again" in m for m in infos) == 2
    await registration.stop()


@_sync
async def test_no_beat_while_the_engine_is_unhealthy_and_stop_deregisters_once() -> None:
    engine = _Engine()
    beats = asyncio.Event()

    def answer(n: int, request: httpx.Request) -> httpx.Response:
        if n == 1:
            engine.healthy = False  # the engine dies after the first heartbeat
            beats.set()
        return httpx.Response(200)

    recorder = _Recorder(answer)
    registration, lifecycle = _registration(
        engine, httpx.MockTransport(recorder), heartbeat_interval_s=0.001
    )
    lifecycle.listening.set()
    registration.start()
    await asyncio.wait_for(beats.wait(), _WAIT_S)
    checks = engine.num_health_checks
    while engine.num_health_checks < checks + 5:  # the loop turns 5 more times, posting nothing
        await asyncio.sleep(0.001)
    assert recorder.paths == [REGISTER_PATH, HEARTBEAT_PATH]
    await registration.stop()  # the lifespan ends without a drain (engine death)
    await registration.stop()
    assert recorder.paths == [REGISTER_PATH, HEARTBEAT_PATH, DEREGISTER_PATH]


@_sync
async def test_nothing_is_posted_when_the_drain_comes_before_the_server_listens() -> None:
    recorder = _Recorder(lambda n, request: httpx.Response(200))
    registration, lifecycle = _registration(_Engine(), httpx.MockTransport(recorder))
    registration.start()
    await lifecycle.drain()
    await asyncio.wait_for(registration._task, _WAIT_S)  # type: ignore[arg-type]
    await registration.stop()
    assert recorder.posts == []


# --- the CLI ---------------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_router_key_from_flag_or_environment() -> None:
    assert resolve_router_key(_parse([]), {}) is None
    assert resolve_router_key(_parse([]), {"SITS_ROUTER_KEY": "env"}) == "env"
    assert resolve_router_key(_parse(["--router-key", "flag"]), {"SITS_ROUTER_KEY": "e"}) == "flag"
    assert resolve_router_key(_parse([]), {"SITS_ROUTER_KEY": ""}) is None


def test_registration_flags() -> None:
    assert registration_arg(_parse([]), "k") is None
    args = _parse(["--register-with", "http://r:8000/", "--port", "8001", "--version-label", "c"])
    settings = registration_arg(args, "k")
    assert settings == RegistrationSettings(
        "http://r:8000", "http://127.0.0.1:8001", advertise_host="127.0.0.1", version_label="c"
    )
    args = _parse(
        ["--register-with", "http://r", "--host", "0.0.0.0", "--advertise-url", "http://h:1"]
    )
    assert registration_arg(args, "k").advertise_url == "http://h:1"  # type: ignore[union-attr]
    args = _parse(["--register-with", "http://r", "--host", "::1", "--port", "9"])
    assert registration_arg(args, "k").advertise_url == "http://[::1]:9"  # type: ignore[union-attr]
    port0 = registration_arg(_parse(["--register-with", "http://r", "--port", "0"]), "k")
    assert port0 is not None and port0.advertise_url is None  # the bound port, once listening
    assert _parse([]).version_label == "stable"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [(["--register-with", "http://r"], {}, "--register-with needs the router's key"),
     (["--register-with", "http://r", "--host", "0.0.0.0"], {"SITS_ROUTER_KEY": "k"},
      "--host '0.0.0.0' is no address the router can reach: give --advertise-url"),
     (["--register-with", "r:8000", "--router-key", "k"], {},
      "--register-with: must be an http(s) URL with a host: 'r:8000'"),
     (["--register-with", "http://r", "--router-key", "k", "--version-label", "a b"], {},
      "--version-label: must be a non-empty label without spaces")],
)  # fmt: skip
def test_bad_fleet_flags_exit_2_before_the_model_loads(argv, env, message, capsys, monkeypatch):
    monkeypatch.delenv("SITS_ROUTER_KEY", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run_serve(_parse(["--model", "/does/not/exist", *argv])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


# --- real servers against a fake router ------------------------------------------------------
class FakeRouter:
    """The three router endpoints on loopback (uvicorn in a thread), recording every post.

    Answers 401 (OpenAI error body) to a wrong or missing router key, else 200.
    """

    def __init__(self, key: str = ROUTER_KEY) -> None:
        self.posts: list[tuple[str, Any]] = []
        self.refused = 0
        self._cond = threading.Condition()
        app = FastAPI()

        async def record(request: Request) -> JSONResponse:
            if request.headers.get("authorization") != f"Bearer {key}":
                with self._cond:
                    self.refused += 1
                    self._cond.notify_all()
                error = {"message": "bad key", "type": "invalid_request_error",
                         "param": None, "code": "invalid_api_key"}  # fmt: skip
                return JSONResponse({"error": error}, status_code=401)
            body = await request.json()
            with self._cond:
                self.posts.append((request.url.path, body))
                self._cond.notify_all()
            return JSONResponse({"ok": True})

        for path in (REGISTER_PATH, HEARTBEAT_PATH, DEREGISTER_PATH):
            app.add_api_route(path, record, methods=["POST"])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: self._server.run(sockets=[self._sock]), daemon=True
        )

    def __enter__(self) -> FakeRouter:
        self._thread.start()
        deadline = time.monotonic() + _WAIT_S
        while not self._server.started:
            assert time.monotonic() < deadline, "the fake router did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def wait(self, predicate: Callable[[FakeRouter], bool], timeout_s: float = _WAIT_S) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self), timeout_s), self.posts

    def paths(self) -> list[str]:
        with self._cond:
            return [path for path, _ in self.posts]


def test_a_live_replica_registers_beats_and_deregisters_when_draining(
    tiny_moe_dir: Path, engine_factory
) -> None:
    with FakeRouter() as router:
        registration = RegistrationSettings(
            router.url, advertise_url=None, version_label="canary", heartbeat_interval_s=0.05
        )
        settings = ServerSettings(router_key=ROUTER_KEY, registration=registration)
        live = LiveServer(engine_factory(tiny_moe_dir, max_num_seqs=4), settings)
        with live:
            router.wait(lambda r: len(r.posts) >= 1)
            path, body = router.posts[0]
            hb = Heartbeat.from_json(body)
            assert path == REGISTER_PATH and hb.url == live.base_url  # the bound port
            assert hb.version_label == "canary" and hb.capacity == 4
            assert hb.max_model_len == 1024 and hb.load.draining is False
            with live.http() as http:
                (model,) = [m["id"] for m in http.get("/v1/models").json()["data"]]
                assert hb.models == (model,)
                done = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
                assert done.status_code == 200
            # A later heartbeat reports that request's latencies.
            router.wait(lambda r: any(b.get("load", {}).get("ttft_p50_s") for _, b in r.posts))
            assert router.paths()[1:] == [HEARTBEAT_PATH] * (len(router.posts) - 1)
            assert live.loop is not None and live.server is not None
            live.loop.call_soon_threadsafe(live.server.start_drain)  # as SIGTERM does
            router.wait(lambda r: DEREGISTER_PATH in r.paths())
            assert live.wait_until(lambda: live.stopped, _WAIT_S)
        paths = router.paths()
        assert paths.count(DEREGISTER_PATH) == 1 and paths[-1] == DEREGISTER_PATH
        assert router.posts[-1][1] == {"url": live.base_url}
        assert router.refused == 0


def test_sits_serve_registers_and_deregisters_on_sigterm(tiny_moe_dir: Path, tmp_path) -> None:
    with FakeRouter() as router:
        port = free_port()
        cmd = [
            sys.executable, "-m", "sits.cli.main", "serve",
            "--model", str(tiny_moe_dir),
            "--port", str(port),
            "--dtype", "float32",
            "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(16 << 20),
            "--log-level", "warning",
            "--register-with", router.url,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SITS_API_KEY": ""}
        env["SITS_ROUTER_KEY"] = ROUTER_KEY
        with open(tmp_path / "serve.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                router.wait(lambda r: len(r.posts) >= 1 or proc.poll() is not None)
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                assert router.posts[0][0] == REGISTER_PATH
                assert router.posts[0][1]["url"] == f"http://127.0.0.1:{port}"
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
                proc.send_signal(signal.SIGTERM)
                router.wait(lambda r: DEREGISTER_PATH in r.paths())
                assert proc.wait(HANG_S) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
        assert router.paths().count(DEREGISTER_PATH) == 1
        assert router.posts[-1][1] == {"url": f"http://127.0.0.1:{port}"}
