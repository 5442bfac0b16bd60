"""Injected clocks: admission code reads time only through a `Clock`, so tests are exact.

Invariant: `monotonic()` never decreases (FakeClock refuses to go back).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic time in seconds (arbitrary origin)."""

    def monotonic(self) -> float:
        """Seconds since an arbitrary fixed origin; never decreases."""
        ...


class SystemClock:
    """The process's monotonic clock (`time.monotonic`)."""

    __slots__ = ()

    def monotonic(self) -> float:
        """`time.monotonic()` in seconds."""
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told to (tests).

    Args:
        start_s: the initial time in seconds.
    """

    __slots__ = ("_now_s",)

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = float(start_s)

    def monotonic(self) -> float:
        """The current fake time in seconds."""
        return self._now_s

    def advance(self, seconds: float) -> float:
        """Move forward by `seconds` (>= 0) and return the new time.

        Raises:
            ValueError: `seconds` < 0.
        """
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now_s += seconds
        return self._now_s

    def set(self, now_s: float) -> None:
        """Jump to `now_s` (>= the current time).

        Raises:
            ValueError: `now_s` is before the current time.
        """
        if now_s < self._now_s:
            raise ValueError(f"a monotonic clock cannot go back ({self._now_s} -> {now_s})")
        self._now_s = float(now_s)
