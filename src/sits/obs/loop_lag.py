"""Event-loop lag: how late the server's asyncio loop runs a callback that is due.

The HTTP side (parsing, admission, detokenizing, SSE writes) runs on one asyncio loop, and the
engine's step loop in a thread of the same process shares the GIL with it. When the engine
thread runs Python without pause (kernel launches of eager steps), every system call of the
loop (accept, recv, send) must win the GIL back, which takes up to the interpreter's switch
interval each time (the GIL "convoy effect", CPython bpo-7946): a loop that sends thousands of
stream chunks a second then falls behind, and every client sees that delay in its TTFT and
ITL even though the engine served the request on time. `EventLoopLagMonitor` measures it:
every `interval_s` it sleeps and records (actual wake-up - due time) in the histogram
`sits:event_loop_lag_seconds`. Its warning is for starvation an operator should act on, not
for one late timer: it judges windows of `warn_every_s`, counts only lag while requests are in
flight, and warns (once per window) when the loop ran behind for at least `warn_share` of the
window and its worst lag passed `warn_lag_s`. What the warning recommends depends on the
engine (`starvation_advice`): the GIL knobs for an engine thread beside a GPU, never those on
a CPU, where the engine's compute and the HTTP side share the cores.
`sits serve --gil-switch-interval-ms` (`apply_switch_interval`) is the knob that bounds the
convoy. The other stall of the whole process, the garbage collector's, is
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
DEFAULT_WARN_SHARE = 0.25  # behind a quarter of the time: starved, not one late timer
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


def starvation_advice(device_type: str | None, engine_process: bool) -> str:
    """What the starvation warning recommends.

    Args:
        device_type: where the engine computes ("cuda", "cpu"; None when unknown).
        engine_process: the engine's step loop runs in its own process.

    Returns:
        The advice (the warning's last clause): the GIL knobs only for an engine thread
        beside a GPU, where its kernel launches hold the GIL.
    """
    if device_type == "cuda" and not engine_process:
        return "see --engine-process and --gil-switch-interval-ms, and sits:gc_pause_seconds"
    if device_type == "cuda":
        return (
            "the engine runs in its own process: see what else busies this machine's CPUs, "
            "and sits:gc_pause_seconds"
        )
    if device_type == "cpu":
        return (
            "the engine computes on the CPU and shares its cores with the HTTP side: give the "
            "server more cores or fewer busy neighbours, and see sits:gc_pause_seconds"
        )
    return "see sits:gc_pause_seconds"


class EventLoopLagMonitor:
    """Background task recording the asyncio loop's lag (see the module docstring).

    Args:
        registry: where `sits:event_loop_lag_seconds` (label model_name) is registered.
        model_name: the label value.
        interval_s: seconds between samples (> 0).
        warn_every_s: the length of a warning window in seconds (at most one warning each).
        warn_lag_s: a window warns only if its worst lag while serving passed this many
            seconds,
        warn_share: and only if the loop ran behind (the sum of its lags while serving) for
            at least this share of the window.
        advice: what the warning recommends (`starvation_advice`).
        is_idle: True when the server has no request in flight: lag then delays nobody and
            does not count towards a warning; while the monitor runs, full garbage
            collections wait for such moments (`full_collections`).

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
        warn_share: float = DEFAULT_WARN_SHARE,
        advice: str = starvation_advice(None, engine_process=False),
        is_idle: Callable[[], bool] = lambda: True,
    ) -> None:
        if not interval_s > 0:
            raise InvalidParameterError("interval_s", f"must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.warn_lag_s = warn_lag_s
        self.warn_every_s = warn_every_s
        self.warn_share = warn_share
        self.advice = advice
        self.max_lag_s = 0.0
        self.num_samples = 0
        self._window_start_s: float | None = None
        self._window_behind_s = 0.0
        self._window_worst_s = 0.0
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

    def record(self, lag_s: float, now_s: float, busy: bool = True) -> str | None:
        """Record one sample of `lag_s` seconds taken at `now_s` (time.monotonic()), `busy`
        when requests were in flight; returns the warning when this sample ends a window of
        starvation (module docstring), else None."""
        lag_s = max(lag_s, 0.0)
        self.num_samples += 1
        self.max_lag_s = max(self.max_lag_s, lag_s)
        self._histogram.observe(lag_s)
        if self._window_start_s is None:
            self._window_start_s = now_s
        if busy:
            self._window_behind_s += lag_s
            self._window_worst_s = max(self._window_worst_s, lag_s)
        window_s = now_s - self._window_start_s
        if window_s < self.warn_every_s:
            return None
        behind_s, worst_s = self._window_behind_s, self._window_worst_s
        self._window_start_s, self._window_behind_s, self._window_worst_s = now_s, 0.0, 0.0
        if worst_s <= self.warn_lag_s or behind_s < self.warn_share * window_s:
            return None
        message = (
            f"the HTTP side is starved: its event loop ran {behind_s:.1f} s behind in the "
            f"last {window_s:.1f} s while serving (worst lag {worst_s:.3f} s, max so far "
            f"{self.max_lag_s:.3f} s), a delay in every client's TTFT and ITL; {self.advice}"
        )
        logger.warning("%s", message)
        return message

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
            idle = self.is_idle()
            self.record(now_s - due_s, now_s, busy=not idle)
            self.full_collections.tick(idle)

    async def stop(self) -> None:
        """Stop sampling."""
        self.gc_pauses.close()
        self.full_collections.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
