"""Signals on a real `sits serve` with live streams, beside tests/server/test_sigterm.py (which
covers SIGTERM's drain and a second SIGTERM): SIGINT (Ctrl-C) drains like SIGTERM, and a second
SIGINT cuts the streams with their error event and exits 1."""

from __future__ import annotations

import signal

import pytest

from tests.server.test_sigterm import (
    assert_completed,
    assert_cut,
    cut_live_streams,
    drain_live_streams,
)
from tests.waits import HANG_S

pytestmark = pytest.mark.reliability


def test_sigint_drains_live_streams_then_exits_0(serve, figures) -> None:
    server = serve("--shutdown-timeout", str(HANG_S))  # the streams end well before
    streams = drain_live_streams(server, signal.SIGINT)
    figures.update(requests=4, lost=sum(s.error is not None for s in streams), **{"5xx": 0})
    assert_completed(streams)
    assert server.proc.wait(HANG_S) == 0


def test_a_second_sigint_cuts_streams_with_their_error_event_and_exits_1(serve, figures) -> None:
    server = serve("--shutdown-timeout", str(HANG_S))  # the drain alone would wait
    streams = cut_live_streams(server, signal.SIGINT)
    figures.update(requests=3, lost=sum(s.error is not None for s in streams), **{"5xx": 0})
    assert_cut(streams)
    assert server.proc.wait(HANG_S) == 1
