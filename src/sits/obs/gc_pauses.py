"""Python garbage-collector pauses: freeze the startup heap, and time every collection.

A CPython collection of the oldest generation walks every tracked container object, and it
stops every thread of the process while it runs. A serving process holds a large heap that is
never garbage (torch, transformers, the tokenizer, FastAPI, the model's modules: about 250,000
objects, a 0.11 s full collection on our 2-core CPU machine), and under load it allocates fast
enough to collect the oldest generation every few seconds. Each such pause delays every
request's next token (ITL) in the engine process and every socket send in the HTTP process.

- `freeze_startup_heap` runs one full collection and then moves every surviving object to the
  permanent generation (`gc.freeze`, CPython >= 3.7: "Freeze all the objects tracked by the
  garbage collector; move them to a permanent generation and ignore them in all the future
  collections"), so later collections only walk what serving allocated. Call it once, when
  startup is done (model built, app ready).
- `GcPauseMonitor` registers a `gc.callbacks` hook that times each collection and passes
  (generation, seconds) to an observer (a Prometheus histogram in the HTTP process), and logs a
  warning (at most one per `warn_every_s`) for a pause over `warn_pause_s`.
- `IdleFullCollections` takes the full collections over and runs them when the process is
  idle (or, under unbroken load, at most every few minutes).

Invariants: the hook never raises into the collector (the observer's errors are logged); the
monitor is installed at most once per instance and `close` removes it.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object out of future collections.

    Returns:
        Objects now in the permanent generation (`gc.get_freeze_count()`).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauseMonitor:
    """Times every garbage collection of this process (see the module docstring).

    Args:
        observe: called with (generation 0-2, pause seconds) after each collection, or None.
        warn_pause_s: a pause above this many seconds is logged as a warning.
        warn_every_s: at most one such warning per this many seconds.
        where: named in the warning (e.g. "http" or "engine").
        clock: monotonic seconds (tests pass a fake).

    Attributes:
        max_pause_s: the longest pause seen so far, seconds.
        num_collections: collections timed so far.
    """

    def __init__(
        self,
        observe: Callable[[int, float], None] | None = None,
        warn_pause_s: float = 0.05,
        warn_every_s: float = 10.0,
        where: str = "process",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.observe = observe
        self.warn_pause_s = warn_pause_s
        self.warn_every_s = warn_every_s
        self.where = where
        self.clock = clock
        self.max_pause_s = 0.0
        self.num_collections = 0
        self._started_s: float | None = None
        self._last_warning_s = -math.inf
        self._installed = False

    def install(self) -> GcPauseMonitor:
        """Register the hook in `gc.callbacks` (again is a no-op); returns self."""
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def close(self) -> None:
        """Remove the hook."""
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_s = self.clock()
        elif phase == "stop" and self._started_s is not None:
            now_s = self.clock()
            self.record(int(info.get("generation", 2)), now_s - self._started_s, now_s)
            self._started_s = None

    def record(self, generation: int, pause_s: float, now_s: float) -> None:
        """Account one collection of `generation` that took `pause_s` seconds, ending at
        `now_s` (the same clock)."""
        self.num_collections += 1
        self.max_pause_s = max(self.max_pause_s, pause_s)
        if self.observe is not None:
            try:
                self.observe(generation, pause_s)
            except Exception:  # noqa: BLE001 - never raise into the collector
                logger.exception("gc pause observer failed")
        if pause_s > self.warn_pause_s and now_s - self._last_warning_s >= self.warn_every_s:
            self._last_warning_s = now_s
            logger.warning(
                "%s: garbage collection of generation %d paused every thread for %.3f s "
                "(max so far %.3f s, %d objects frozen)",
                self.where,
                generation,
                pause_s,
                self.max_pause_s,
                gc.get_freeze_count(),
            )


class IdleFullCollections:
    """Moves full (oldest-generation) collections to moments when the process is idle.

    Freezing the startup heap leaves the live serving state: under overload thousands of
    queued and running requests, which a full collection must walk every time (measured on
    the H200 behind an FCFS backlog: 0.07 s growing to 0.5 s, every ~10 s, each one a stall of
    every stream). `install` raises the oldest generation's threshold out of reach (the
    younger generations keep CPython's thresholds), and `tick`, called often, runs the full
    collection itself: when the process is idle and at least `min_idle_interval_s` passed
    since the last one and something was promoted since, or under unbroken load every
    `max_interval_s` (cyclic garbage waits in the oldest generation until then).

    Args:
        min_idle_interval_s: shortest gap between idle-time collections, seconds (>= 0).
        max_interval_s: longest gap between full collections under load, seconds (> 0).
        clock: monotonic seconds (tests pass a fake).

    Attributes:
        num_full_collections: full collections `tick` ran.
    """

    NEVER = 1 << 30  # an oldest-generation threshold no count reaches

    def __init__(
        self,
        min_idle_interval_s: float = 5.0,
        max_interval_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_idle_interval_s = min_idle_interval_s
        self.max_interval_s = max_interval_s
        self.clock = clock
        self.num_full_collections = 0
        self._last_s = clock()
        self._saved: tuple[int, int, int] | None = None

    def install(self) -> IdleFullCollections:
        """Take the oldest generation's collections over (again is a no-op); returns self."""
        if self._saved is None:
            self._saved = gc.get_threshold()
            gc.set_threshold(self._saved[0], self._saved[1], self.NEVER)
        return self

    def close(self) -> None:
        """Give the thresholds back."""
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def tick(self, idle: bool) -> bool:
        """Run a full collection if one is due (see the class docstring); True if it ran."""
        now_s = self.clock()
        since_s = now_s - self._last_s
        promoted = gc.get_count()[2] > 0  # younger collections since the last full one
        due = since_s >= self.max_interval_s or (
            idle and promoted and since_s >= self.min_idle_interval_s
        )
        if due:
            gc.collect()
            self._last_s = self.clock()
            self.num_full_collections += 1
        return due
