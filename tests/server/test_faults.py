"""Faults: engine loop death and hang (C17), API keys, drain (in-process), exit on death."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from sits.server.context import ServerSettings
from tests.server.live import LiveServer
from tests.waits import HANG_S

PROMPT = "def fibonacci(n):"
LONG_STREAM = {
    "prompt": PROMPT,
    "max_tokens": 1000,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


def _events(lines) -> list[str]:
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def _first_event_then(resp: httpx.Response, action) -> list[str]:
    """Read the first event, run `action()`, then read the stream to its end."""
    lines = resp.iter_lines()
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[len("data: ") :])["choices"]
    action()
    return _events(lines)


def _assert_ends_with_error(events: list[str], code: str) -> None:
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == code and error["type"] == "service_unavailable_error"


def _assert_refused(live: LiveServer, code: str) -> None:
    with live.http(timeout=5) as http:
        resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert resp.status_code == 503 and resp.json()["error"]["code"] == code
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == code
        assert resp.headers["retry-after"] == health.headers["retry-after"] == "1"


def test_c17_engine_loop_death(tiny_moe_dir, engine_factory) -> None:
    def boom(*args) -> list:
        raise RuntimeError("injected engine failure")

    with LiveServer(engine_factory(tiny_moe_dir)) as live, live.http() as http:
        with http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:
            events = _first_event_then(resp, lambda: setattr(live.engine.engine_core, "step", boom))
        _assert_ends_with_error(events, "engine_dead")
        assert live.wait_until(lambda: http.get("/health").status_code == 503)
        _assert_refused(live, "engine_dead")
        assert live.wait_until(lambda: live.fatal_codes == [1])


def test_c17_engine_loop_hang(tiny_moe_dir, engine_factory) -> None:
    release = threading.Event()

    def hang(*args) -> list:
        release.wait(HANG_S)
        return []

    make_engine = engine_factory(tiny_moe_dir, health_timeout_s=1.0, step_timeout_s=1.0)
    try:
        with LiveServer(make_engine) as live, live.http() as http:
            body = {**LONG_STREAM, "stream": False}
            results: list[httpx.Response] = []
            pending = threading.Thread(
                target=lambda: results.append(http.post("/v1/completions", json=body))
            )
            with http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:

                def hang_engine() -> None:
                    pending.start()
                    live.wait_until(lambda: live.engine.stats().num_running == 2)
                    live.engine.engine_core.step = hang

                events = _first_event_then(resp, hang_engine)
            # The stream and the non-streamed request in flight both fail once the loop hangs.
            _assert_ends_with_error(events, "engine_dead")
            pending.join(HANG_S)
            assert results[0].status_code == 503
            assert results[0].json()["error"]["code"] == "engine_dead"
            _assert_refused(live, "engine_dead")
            assert live.fatal_codes == [1]
            assert "over the step timeout of 1 s" in str(live.engine.dead_error)
            release.set()  # let the engine thread go before the server shuts it down
    finally:
        release.set()


def test_a_long_step_is_not_a_hung_loop(tiny_moe_dir, engine_factory) -> None:
    """One step of 2.5 s (a big prompt chunk on a CPU) with a 1 s health timeout: the server
    stays healthy and the request completes, because the step is within its 30 s bound."""
    make_engine = engine_factory(tiny_moe_dir, health_timeout_s=1.0, step_timeout_s=30.0)
    with LiveServer(make_engine) as live, live.http() as http:
        core = live.engine.engine_core
        step = core.step
        slow = threading.Event()
        polled_during = threading.Event()  # /health answered 3 times inside the slow step
        during: list[int] = []

        def slow_once(*args) -> list:
            if not slow.is_set():
                slow.set()
                threading.Event().wait(2.5)  # longer than the 1 s health timeout
                polled_during.wait(HANG_S)  # and long enough for the poller, however busy
            return step(*args)

        core.step = slow_once
        health: list[int] = []
        done = threading.Event()

        def poll_health() -> None:
            with live.http() as own:  # a client per thread
                while not done.wait(0.2):
                    status = own.get("/health").status_code
                    health.append(status)
                    if slow.is_set() and not polled_during.is_set():
                        during.append(status)
                        if len(during) >= 3:
                            polled_during.set()

        poller = threading.Thread(target=poll_health)
        poller.start()
        try:
            body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
            resp = http.post("/v1/completions", json=body)
        finally:
            done.set()
            poller.join(HANG_S)
        assert slow.is_set()
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        assert during == [200, 200, 200]  # polled inside the long step: healthy throughout
        assert set(health) == {200}
        assert live.engine.is_healthy() and live.fatal_codes == []


def test_api_key(tiny_moe_dir, engine_factory) -> None:
    settings = ServerSettings(api_key="sekret")
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live:
        with pytest.raises(openai.AuthenticationError) as err:
            live.client(api_key="wrong").models.list()
        assert err.value.body["code"] == "invalid_api_key"
        ok = live.client(api_key="sekret").completions.create(
            prompt=PROMPT, max_tokens=2, model=None
        )
        assert ok.usage.completion_tokens <= 2
        with live.http() as http:
            assert http.get("/v1/models").status_code == 401
            for path in ("/tokenize", "/detokenize", "/v1/completions"):
                assert http.post(path, json={}).status_code == 401, path
            wrong = http.get("/v1/models", headers={"Authorization": "Bearer sekret2"})
            assert wrong.status_code == 401
            assert wrong.json()["error"]["message"] == "Incorrect API key provided."
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 200


def test_drain_finishes_open_streams_and_refuses_new_requests(tiny_moe_dir, engine_factory) -> None:
    settings = ServerSettings(shutdown_timeout_s=60)
    body = {**LONG_STREAM, "max_tokens": 120, "stream_options": {"include_usage": True}}
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live, live.http() as http:
        drained = []

        def start_drain() -> None:
            drained.append(live.submit(live.lifecycle.drain()))
            live.wait_until(lambda: live.lifecycle.draining)
            _assert_refused(live, "draining")

        with http.stream("POST", "/v1/completions", json=body) as resp:
            events = _first_event_then(resp, start_drain)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 120
        assert drained[0].result(HANG_S) is True


def test_drain_timeout_cuts_open_streams(tiny_moe_dir, engine_factory) -> None:
    settings = ServerSettings(shutdown_timeout_s=0.3)
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live, live.http() as http:
        total = live.engine.stats().num_total_blocks
        drained = []
        with http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:
            events = _first_event_then(
                resp, lambda: drained.append(live.submit(live.lifecycle.drain()))
            )
        _assert_ends_with_error(events, "draining")
        assert drained[0].result(HANG_S) is False
        assert live.wait_until(lambda: live.engine.stats().num_free_blocks == total)


def test_engine_death_stops_the_server_with_exit_code_1(tiny_moe_dir, engine_factory) -> None:
    def boom(*args) -> list:
        raise RuntimeError("injected engine failure")

    with LiveServer(engine_factory(tiny_moe_dir), exit_on_fatal=True) as live:
        live.engine.engine_core.step = boom
        with live.http() as http:
            resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        assert resp.status_code == 503
        assert live.wait_until(lambda: live.stopped)
        assert live.server.exit_code == 1
