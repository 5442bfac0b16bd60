"""Waiting in tests: for a condition or an event, with a ceiling that only catches a hang.

A busy 2-core machine (a second test worker, a build beside it) runs a server's startup, a
stream or a child's exit several times slower than an idle one; a test that waited a budget
sized for an idle machine failed there. Tests wait for what they need (readiness, an event, a
state) up to `HANG_S`, and never assert on speed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HANG_S = 600.0  # seconds: a wait this long is a hang, whatever the machine's load


def wait_until(predicate: Callable[[], bool], timeout_s: float = HANG_S) -> bool:
    """Poll `predicate` every 10 ms until it holds or `timeout_s` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


async def async_wait_until(predicate: Callable[[], bool], timeout_s: float = HANG_S) -> bool:
    """`wait_until` on an event loop: polls every 10 ms without blocking the loop."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()
