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
