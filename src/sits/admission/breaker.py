"""Circuit breaker around the engine: closed -> open -> half-open -> closed (or open again).

Rules (all numbers in `BreakerConfig`):
- CLOSED: every outcome (a request or an engine step, as the caller reports them) enters a
  sliding window of `window_s` seconds. After each outcome the breaker opens if the last
  `max_consecutive_failures` outcomes all failed, or if more than `failure_ratio` of the
  window's outcomes failed while the window holds at least `min_samples` outcomes.
- OPEN: `allow()` fails fast (HTTP 503, Retry-After = seconds left, >= 1) for `open_s`; outcomes
  reported meanwhile (requests admitted before opening) are ignored.
- HALF_OPEN (after `open_s`): `allow()` lets exactly one probe through; others fail fast with
  Retry-After 1. The next reported outcome decides: success -> CLOSED with an empty window,
  failure -> OPEN for another `open_s`. A probe that never ran is handed back with
  `release_probe()`; one that reports nothing for `probe_timeout_s` is replaced by a new probe.
Time comes from the injected clock; thread-safe (one lock).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from enum import Enum

from sits.admission.controller import Clock, SystemClock
from sits.core.errors import InvalidParameterError


class BreakerState(Enum):
    """Circuit breaker state."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Circuit breaker limits.

    Attributes:
        failure_ratio: open when failed / all outcomes in the window is > this, in [0, 1).
        window_s: sliding window length, seconds, > 0.
        min_samples: the ratio rule needs at least this many outcomes in the window, >= 1.
        max_consecutive_failures: open after this many failures in a row, >= 1.
        open_s: fast-fail period before a probe, seconds, > 0.
        probe_timeout_s: a probe silent this long is replaced by a new one, seconds, > 0.

    Raises:
        InvalidParameterError: a value out of range.
    """

    failure_ratio: float = 0.3
    window_s: float = 60.0
    min_samples: int = 10
    max_consecutive_failures: int = 5
    open_s: float = 30.0
    probe_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.failure_ratio < 1:
            raise InvalidParameterError("failure_ratio", f"must be in [0, 1): {self.failure_ratio}")
        for name in ("min_samples", "max_consecutive_failures"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"must be >= 1: {getattr(self, name)}")
        for name in ("window_s", "open_s", "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(name, f"must be > 0: {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class BreakerDecision:
    """Outcome of `CircuitBreaker.allow`.

    Attributes:
        allowed: the request may go to the engine.
        retry_after_s: integer seconds >= 1 when refused (the 503's Retry-After), else None.
        is_probe: this request is the half-open probe; report its outcome, or `release_probe()`
            if it never reaches the engine.
    """

    allowed: bool
    retry_after_s: int | None = None
    is_probe: bool = False


class CircuitBreaker:
    """The breaker (rules in the module docstring).

    Args:
        config: limits (default `BreakerConfig()`: 30 % in 60 s with >= 10 samples, or 5 in a
            row; open 30 s).
        clock: time source (default `SystemClock`).
    """

    def __init__(self, config: BreakerConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or BreakerConfig()
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._window: deque[tuple[float, bool]] = deque()  # (time_s, failed)
        self._num_failed_in_window = 0
        self._num_consecutive_failures = 0
        self._opened_s = 0.0
        self._probe_started_s: float | None = None
        self.num_opened = 0

    @property
    def state(self) -> BreakerState:
        """The state now (OPEN turns HALF_OPEN once `open_s` has passed)."""
        with self._lock:
            self._advance(self._clock.monotonic())
            return self._state

    def window_counts(self) -> tuple[int, int]:
        """(outcomes, failures) in the sliding window now (CLOSED state's evidence)."""
        with self._lock:
            self._prune(self._clock.monotonic())
            return len(self._window), self._num_failed_in_window

    def allow(self) -> BreakerDecision:
        """May a new request go to the engine now?"""
        with self._lock:
            now_s = self._clock.monotonic()
            self._advance(now_s)
            if self._state is BreakerState.CLOSED:
                return BreakerDecision(True)
            if self._state is BreakerState.OPEN:
                left_s = self._opened_s + self.config.open_s - now_s
                return BreakerDecision(False, max(1, math.ceil(left_s - 1e-9)))
            probe = self._probe_started_s
            if probe is None or now_s - probe >= self.config.probe_timeout_s:
                self._probe_started_s = now_s
                return BreakerDecision(True, is_probe=True)
            return BreakerDecision(False, 1)

    def release_probe(self) -> None:
        """Hand back a probe that never reached the engine (e.g. rejected by rate limits)."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:
                self._probe_started_s = None

    def record_success(self) -> None:
        """Report one successful request or step."""
        self._record(failed=False)

    def record_failure(self) -> None:
        """Report one failed request or step."""
        self._record(failed=True)

    def _record(self, failed: bool) -> None:
        with self._lock:
            now_s = self._clock.monotonic()
            self._advance(now_s)
            if self._state is BreakerState.OPEN:
                return
            if self._state is BreakerState.HALF_OPEN:
                if failed:
                    self._open(now_s)
                else:
                    self._close()
                return
            self._prune(now_s)
            self._window.append((now_s, failed))
            self._num_failed_in_window += failed
            self._num_consecutive_failures = self._num_consecutive_failures + 1 if failed else 0
            num = len(self._window)
            ratio = self._num_failed_in_window / num
            if self._num_consecutive_failures >= self.config.max_consecutive_failures or (
                num >= self.config.min_samples and ratio > self.config.failure_ratio
            ):
                self._open(now_s)

    def _advance(self, now_s: float) -> None:
        if self._state is BreakerState.OPEN and now_s - self._opened_s >= self.config.open_s:
            self._state = BreakerState.HALF_OPEN
            self._probe_started_s = None

    def _prune(self, now_s: float) -> None:
        horizon_s = now_s - self.config.window_s
        while self._window and self._window[0][0] <= horizon_s:
            _, failed = self._window.popleft()
            self._num_failed_in_window -= failed

    def _open(self, now_s: float) -> None:
        self._state = BreakerState.OPEN
        self._opened_s = now_s
        self._probe_started_s = None
        self.num_opened += 1

    def _close(self) -> None:
        self._state = BreakerState.CLOSED
        self._window.clear()
        self._num_failed_in_window = 0
        self._num_consecutive_failures = 0
        self._probe_started_s = None
