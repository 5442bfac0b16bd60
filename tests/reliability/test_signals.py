"""Signals on a real `sits serve` with live streams, beside tests/server/test_sigterm.py (which
covers SIGTERM's drain and a second SIGTERM): SIGINT (Ctrl-C) drains like SIGTERM, and a second
SIGINT cuts the streams with their error event and exits 1."""

from __future__ import annotations

import json
import signal

import pytest

from tests.reliability.conftest import PROMPT
from tests.server.test_sigterm import _refused_while_draining, _start_streams
from tests.waits import HANG_S

pytestmark = pytest.mark.reliability


def test_sigint_drains_live_streams_then_exits_0(serve, figures) -> None:
    server = serve("--shutdown-timeout", str(HANG_S))  # the streams end well before
    body = {
        "prompt": PROMPT,
        "max_tokens": 150,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streams = _start_streams(server.base_url, body, 3)
    server.proc.send_signal(signal.SIGINT)
    _refused_while_draining(server.base_url)
    for stream in streams:
        stream.join(HANG_S)
    figures.update(requests=4, lost=sum(s.error is not None for s in streams), **{"5xx": 0})
    for stream in streams:
        assert stream.error is None
        assert stream.events[-1] == "[DONE]"
        assert json.loads(stream.events[-2])["usage"]["completion_tokens"] == 150
    assert server.proc.wait(HANG_S) == 0


def test_a_second_sigint_cuts_streams_with_their_error_event_and_exits_1(serve, figures) -> None:
    server = serve("--shutdown-timeout", str(HANG_S))  # the drain alone would wait
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    streams = _start_streams(server.base_url, body, 2)
    server.proc.send_signal(signal.SIGINT)
    _refused_while_draining(server.base_url)
    server.proc.send_signal(signal.SIGINT)
    for stream in streams:
        stream.join(HANG_S)
    figures.update(requests=3, lost=sum(s.error is not None for s in streams), **{"5xx": 0})
    for stream in streams:
        assert stream.error is None
        assert stream.events[-1] == "[DONE]"
        assert json.loads(stream.events[-2])["error"]["code"] == "draining"
    assert server.proc.wait(HANG_S) == 1
