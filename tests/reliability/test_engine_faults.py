"""Faults of the engine process of `sits serve --engine-process`: kill -9 fails the open
requests with 503 (streams with their error event) and the server exits 1; SIGSTOP mid-step
turns /health 503 "engine_stalled" past --engine-stall-floor, SIGCONT brings it back, and a
step frozen past --engine-step-timeout ends the engine and the server (exit 1)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading

import httpx
import pytest

from tests.reliability.conftest import PROMPT, Serve
from tests.server.test_sigterm import _start_streams
from tests.waits import HANG_S, wait_until

pytestmark = pytest.mark.reliability

LONG = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}


def _health_code(server: Serve) -> str | None:
    """None while /health answers 200; else its error code."""
    resp = server.health()
    return None if resp.status_code == 200 else resp.json()["error"]["code"]


def _kill_if_alive(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _last_error_code(events: list[str]) -> str:
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["error"]["code"]


def test_kill_9_of_the_engine_fails_open_requests_with_503_and_exits_1(serve, figures) -> None:
    server = serve("--engine-process")
    streams = _start_streams(server.base_url, LONG, 2)
    plain: list[httpx.Response] = []
    body = {**LONG, "stream": False}
    thread = threading.Thread(
        target=lambda: plain.append(
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=HANG_S)
        )
    )
    thread.start()
    assert wait_until(lambda: server.gauges()[1] == 3)  # all three running
    os.kill(server.engine_pid(), signal.SIGKILL)
    thread.join(HANG_S)
    for stream in streams:
        stream.join(HANG_S)
    lost = sum(s.error is not None for s in streams)
    figures.update(requests=3, lost=lost, expected_503=1, **{"5xx": 0})
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "engine_dead"
    for stream in streams:
        assert stream.error is None and _last_error_code(stream.events) == "engine_dead"
    assert server.proc.wait(HANG_S) == 1


def test_a_frozen_engine_turns_health_503_then_recovers_or_ends(serve, figures) -> None:
    # The stall limit is max(1 s, 10x the slow steps) capped at the step timeout: 20 s leaves a
    # busy machine's slow steps room under it, and the SIGCONT below room to come in time.
    server = serve("--engine-process", "--engine-stall-floor", "1", "--engine-step-timeout", "20")
    engine_pid = server.engine_pid()
    (stream,) = _start_streams(server.base_url, {**LONG, "max_tokens": 200}, 1)
    os.kill(engine_pid, signal.SIGSTOP)  # mid-step: a stream is decoding
    try:
        assert wait_until(lambda: _health_code(server) == "engine_stalled")
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert wait_until(lambda: _health_code(server) is None)
    stream.join(HANG_S)
    assert stream.error is None and stream.events[-1] == "[DONE]"
    assert json.loads(stream.events[-2])["choices"][0]["finish_reason"] == "length"
    # Frozen past the hard timeout: the engine counts as hung and the server ends.
    (stream,) = _start_streams(server.base_url, LONG, 1)
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        stream.join(HANG_S)
        assert stream.error is None and _last_error_code(stream.events) == "engine_dead"
        assert server.proc.wait(HANG_S) == 1
    finally:
        _kill_if_alive(engine_pid)  # a frozen child ignores the server's stop
    figures.update(requests=2, lost=0, **{"5xx": 0})
