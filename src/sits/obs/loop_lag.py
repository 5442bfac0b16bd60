"""Event-loop lag: how late the server's asyncio loop runs a callback that is due.

The HTTP side (parsing, admission, detokenizing, SSE writes) runs on one asyncio loop, and the
engine's step loop in a thread of the same process shares the GIL with it. When the engine
thread runs Python without pause (kernel launches of eager steps), every system call of the
loop (accept, recv, send) must win the GIL back, which takes up to the interpreter's switch
interval each time (the GIL "convoy effect", CPython bpo-7946): a loop that sends thousands of
stream chunks a second then falls behind, and every client sees that delay in its TTFT and
ITL even though the engine served the request on time. `EventLoopLagMonitor` measures it:
every `interval_s` it sleeps and records (actual wake-up - due time) in the histogram
`sits:event_loop_lag_seconds`, and logs a warning (at most once per `warn_every_s`) when the
lag passes `warn_lag_s`. `sits serve --gil-switch-interval-ms` (`apply_switch_interval`) is the
knob that bounds the convoy. The other stall of the whole process, the garbage collector's, is
timed by `gc_pauses` (`sits.obs.gc_pauses`) into `sits:gc_pause_seconds` while the monitor
runs, and its full collections wait for idle moments (`full_collections`).

Invariants: the monitor never raises into the loop; a lag is >= 0 (a wake-up before the due
time counts as 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from sits.core.errors import InvalidParameterError
from sits.obs.gc_pauses import GcPauseMonitor, IdleFullCollections

logger = logging.getLogger(__name__)

MAX_SWITCH_INTERVAL_MS = 1000.0  # a longer hold would only starve the HTTP side
_LAG_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def apply_switch_interval(interval_ms: float) -> float:
    """Set the interpreter's thread switch interval (`sys.setswitchinterval`).

    Args:
        interval_ms: milliseconds a thread may hold the GIL while another waits for it;
            CPython's default is 5. Smaller values let the HTTP loop get the GIL back sooner
            while the engine thread runs Python (see the module docstring).

    Returns:
        The previous interval in milliseconds.

    Raises:
        InvalidParameterError: interval_ms not in (0, MAX_SWITCH_INTERVAL_MS]
            ("gil_switch_interval_ms").
    """
    if not (math.isfinite(interval_ms) and 0 < interval_ms <= MAX_SWITCH_INTERVAL_MS):
        raise InvalidParameterError(
            "gil_switch_interval_ms",
            f"--gil-switch-interval-ms must be a number in (0, {MAX_SWITCH_INTERVAL_MS:g}] ms, "
            f"got {interval_ms}",
        )
    previous_ms = sys.getswitchinterval() * 1e3
    sys.setswitchinterval(interval_ms / 1e3)
    return previous_ms


class EventLoopLagMonitor:
    """Background task recording the asyncio loop's lag (see the module docstring).

    Args:
        registry: where `sits:event_loop_lag_seconds` (label model_name) is registered.
        model_name: the label value.
        interval_s: seconds between samples (> 0).
        warn_lag_s: a lag above this many seconds is logged as a warning.
        warn_every_s: at most one such warning per this many seconds.
        is_idle: True when the server has no request in flight; while the monitor runs, full
            garbage collections wait for such moments (`full_collections`).

    Attributes:
        max_lag_s: the largest lag seen so far, seconds.
        num_samples: samples taken so far.

    Raises:
        InvalidParameterError: interval_s not > 0 ("interval_s").
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        interval_s: float = 0.05,
        warn_lag_s: float = 0.25,
        warn_every_s: float = 10.0,
        is_idle: Callable[[], bool] = lambda: True,
    ) -> None:
        if not interval_s > 0:
            raise InvalidParameterError("interval_s", f"must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.warn_lag_s = warn_lag_s
        self.warn_every_s = warn_every_s
        self.max_lag_s = 0.0
        self.num_samples = 0
        self._last_warning_s = -math.inf
        self._histogram = Histogram(
            "sits:event_loop_lag_seconds",
            "How late the server's asyncio loop woke up for a due timer (HTTP-side delay "
            "added to every request's TTFT and ITL).",
            ["model_name"],
            buckets=_LAG_BUCKETS_S,
            registry=registry,
        ).labels(model_name)
        self._task: asyncio.Task[None] | None = None
        gc_histogram = Histogram(
            "sits:gc_pause_seconds",
            "Pauses of the HTTP process's Python garbage collector (every thread stops).",
            ["model_name", "generation"],
            buckets=_LAG_BUCKETS_S,
            registry=registry,
        )
        by_generation = [gc_histogram.labels(model_name, str(g)) for g in range(3)]
        self.is_idle = is_idle
        self.full_collections = IdleFullCollections()
        self.gc_pauses = GcPauseMonitor(
            lambda generation, pause_s: by_generation[generation].observe(pause_s), where="http"
        )

    def record(self, lag_s: float, now_s: float) -> None:
        """Record one sample of `lag_s` seconds taken at `now_s` (time.monotonic())."""
        lag_s = max(lag_s, 0.0)
        self.num_samples += 1
        self.max_lag_s = max(self.max_lag_s, lag_s)
        self._histogram.observe(lag_s)
        if lag_s > self.warn_lag_s and now_s - self._last_warning_s >= self.warn_every_s:
            self._last_warning_s = now_s
            logger.warning(
                "event loop lag %.3f s (max so far %.3f s): the HTTP side is starved; see "
                "--engine-process and --gil-switch-interval-ms, and sits:gc_pause_seconds",
                lag_s,
                self.max_lag_s,
            )

    def start(self) -> None:
        """Start sampling (call from the running event loop)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run())
            self.gc_pauses.install()
            self.full_collections.install()

    async def _run(self) -> None:
        while True:
            due_s = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now_s = time.monotonic()
            self.record(now_s - due_s, now_s)
            self.full_collections.tick(self.is_idle())

    async def stop(self) -> None:
        """Stop sampling."""
        self.gc_pauses.close()
        self.full_collections.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
