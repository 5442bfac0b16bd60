"""Overload protection: the overload state machine, its admission policy, and the breaker.

Overload state (green / yellow / red) with hysteresis, and the admission policy per state.

Signals (plain numbers, measured by the caller each step or on a timer):
- queue_delay_s: how long the oldest waiting request has waited;
- kv_usage: used fraction of KV blocks, 0..1;
- ttft_ratio: predicted TTFT of the queued work / the tightest TTFT SLO among tenants (ignored
  when no tenant has a TTFT SLO).
Each signal is compared with a yellow and a red threshold; the raw level is the worst signal.

State rules (`OverloadMonitor.update`):
- step up at once, possibly green -> red, when the raw level is above the state;
- step down one level (red -> yellow -> green) only after every signal has stayed below
  `exit_ratio` x the current level's thresholds for `hold_s` seconds without a break; the hold
  restarts after each step down and whenever a signal climbs back over the exit level;
- an idle engine (`calm_down`, the caller's judgement) is green at once.

Admission rules (`OverloadPolicy.admit`); "over quota" means new work would use borrowed
capacity (the tenant holds at least its reserved share); best_effort is always over quota:

    state   within reservation   over quota (best_effort, borrowing burstable or guaranteed)
    green   admit                admit
    yellow  admit                defer (accept, but start it only once green: borrowing stops)
    red     admit                shed: HTTP 503 + Retry-After (shed_retry_after_s)

So a guaranteed tenant within its reservation is never deferred or shed.

Circuit breaker around the engine (`CircuitBreaker`): closed -> open -> half-open -> closed
(or open again).

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
from sits.tenancy.config import Tier

# Response header carrying the state ("green" | "yellow" | "red").
OVERLOAD_HEADER = "x-sits-overload-state"


class OverloadState(Enum):
    """Server load level; `severity` orders them (0 green, 1 yellow, 2 red)."""

    GREEN = "green"
    YELLOW = "yellow"
    RED = "red"

    @property
    def severity(self) -> int:
        """0 for green, 1 for yellow, 2 for red."""
        return _SEVERITY[self]


_SEVERITY = {OverloadState.GREEN: 0, OverloadState.YELLOW: 1, OverloadState.RED: 2}
_BY_SEVERITY = (OverloadState.GREEN, OverloadState.YELLOW, OverloadState.RED)


@dataclass(frozen=True, slots=True)
class OverloadThresholds:
    """Thresholds of the overload monitor (a signal >= threshold reaches that level).

    Attributes:
        yellow_queue_delay_s, red_queue_delay_s: oldest waiting request's wait, seconds.
        yellow_kv_usage, red_kv_usage: used fraction of KV blocks, in (0, 1].
        yellow_ttft_ratio, red_ttft_ratio: predicted TTFT of queued work / tightest TTFT SLO.
        exit_ratio: in (0, 1]; to step down, every signal must be < exit_ratio x the current
            level's threshold.
        hold_s: seconds the signals must stay under the exit levels before one step down.
        backlog_shed_factor: a burstable or best-effort tenant's TTFT limit is this many times
            its TTFT SLO: its new over-quota work is shed once its own oldest queued request
            has waited 90 % of the limit (`ServerQos.backlog_shed_reason`), and the engine
            drops such work not started by then (`QosTicket.start_within_s`); math.inf turns
            both off.

    Raises:
        InvalidParameterError: a threshold <= 0, yellow > red, kv over 1, exit_ratio outside
            (0, 1], hold_s < 0, or backlog_shed_factor <= 0 (or NaN).
    """

    yellow_queue_delay_s: float = 1.0
    red_queue_delay_s: float = 5.0
    yellow_kv_usage: float = 0.90
    red_kv_usage: float = 0.98
    yellow_ttft_ratio: float = 1.0
    red_ttft_ratio: float = 2.0
    exit_ratio: float = 0.8
    hold_s: float = 5.0
    backlog_shed_factor: float = 1.0

    def __post_init__(self) -> None:
        for kind in ("queue_delay_s", "kv_usage", "ttft_ratio"):
            yellow = getattr(self, f"yellow_{kind}")
            red = getattr(self, f"red_{kind}")
            if not (0 < yellow <= red and math.isfinite(red)):
                raise InvalidParameterError(
                    f"red_{kind}", f"need 0 < yellow_{kind} <= red_{kind}, got {yellow}, {red}"
                )
        if self.red_kv_usage > 1:
            raise InvalidParameterError("red_kv_usage", f"must be <= 1, got {self.red_kv_usage}")
        if not 0 < self.exit_ratio <= 1:
            raise InvalidParameterError("exit_ratio", f"must be in (0, 1], got {self.exit_ratio}")
        if not self.hold_s >= 0:
            raise InvalidParameterError("hold_s", f"must be >= 0, got {self.hold_s}")
        if not self.backlog_shed_factor > 0:
            raise InvalidParameterError(
                "backlog_shed_factor", f"must be > 0, got {self.backlog_shed_factor}"
            )


@dataclass(frozen=True, slots=True)
class OverloadSignals:
    """One measurement of the load.

    Attributes:
        queue_delay_s: seconds the oldest waiting request has waited (0 if none waits).
        kv_usage: used fraction of KV blocks, 0..1.
        predicted_ttft_s: predicted seconds until the queued work gets its first token.
        min_ttft_slo_s: tightest TTFT SLO in seconds (e.g. `TenantsConfig.min_ttft_ms / 1000`);
            None disables the TTFT signal.
    """

    queue_delay_s: float = 0.0
    kv_usage: float = 0.0
    predicted_ttft_s: float = 0.0
    min_ttft_slo_s: float | None = None

    @property
    def ttft_ratio(self) -> float:
        """predicted_ttft_s / min_ttft_slo_s (0 without an SLO)."""
        if not self.min_ttft_slo_s:
            return 0.0
        return self.predicted_ttft_s / self.min_ttft_slo_s


def classify(
    signals: OverloadSignals, thresholds: OverloadThresholds, scale: float = 1.0
) -> OverloadState:
    """The worst level any signal reaches against thresholds multiplied by `scale`."""
    t = thresholds
    pairs = (
        (signals.queue_delay_s, t.yellow_queue_delay_s, t.red_queue_delay_s),
        (signals.kv_usage, t.yellow_kv_usage, t.red_kv_usage),
        (signals.ttft_ratio, t.yellow_ttft_ratio, t.red_ttft_ratio),
    )
    level = 0
    for value, yellow, red in pairs:
        if value >= red * scale:
            return OverloadState.RED
        if value >= yellow * scale:
            level = 1
    return _BY_SEVERITY[level]


class OverloadMonitor:
    """The overload state machine (rules in the module docstring).

    Args:
        thresholds: levels, exit ratio and hold time.
        clock: time source (default `SystemClock`).
    """

    def __init__(self, thresholds: OverloadThresholds | None = None, clock: Clock | None = None):
        self.thresholds = thresholds or OverloadThresholds()
        self._clock = clock or SystemClock()
        self._state = OverloadState.GREEN
        self._calm_since_s: float | None = None  # start of the current below-exit stretch
        self._state_since_s = self._clock.monotonic()

    @property
    def state(self) -> OverloadState:
        """The current state (as of the last `update`)."""
        return self._state

    @property
    def state_since_s(self) -> float:
        """Clock time when the current state was entered."""
        return self._state_since_s

    def update(self, signals: OverloadSignals) -> OverloadState:
        """Feed one measurement; returns the (possibly new) state."""
        now_s = self._clock.monotonic()
        raw = classify(signals, self.thresholds)
        if raw.severity > self._state.severity:
            self._enter(raw, now_s)
            return self._state
        calm = classify(signals, self.thresholds, self.thresholds.exit_ratio)
        if calm.severity >= self._state.severity:
            self._calm_since_s = None
            return self._state
        if self._calm_since_s is None:
            self._calm_since_s = now_s
        if now_s - self._calm_since_s >= self.thresholds.hold_s:
            self._enter(_BY_SEVERITY[self._state.severity - 1], now_s)
            self._calm_since_s = now_s if calm.severity < self._state.severity else None
        return self._state

    def calm_down(self) -> OverloadState:
        """Green at once, without the hold: for an idle engine, whose signals are zero by
        construction (nothing queued, nothing running), so no hold can protect anyone."""
        if self._state is not OverloadState.GREEN:
            self._enter(OverloadState.GREEN, self._clock.monotonic())
        self._calm_since_s = None
        return self._state

    def _enter(self, state: OverloadState, now_s: float) -> None:
        self._state = state
        self._state_since_s = now_s
        self._calm_since_s = None


class OverloadAction(Enum):
    """What to do with a new request under the current load."""

    ADMIT = "admit"
    DEFER = "defer"  # accept, but start it only when the state is green again
    SHED = "shed"  # refuse: HTTP 503 + Retry-After


@dataclass(frozen=True, slots=True)
class OverloadDecision:
    """Outcome of `OverloadPolicy.admit`.

    Attributes:
        action: admit, defer or shed.
        retry_after_s: integer seconds >= 1 for SHED (the Retry-After header), else None.
    """

    action: OverloadAction
    retry_after_s: int | None = None

    @property
    def admitted(self) -> bool:
        """True unless shed (a deferred request is accepted)."""
        return self.action is not OverloadAction.SHED


@dataclass(frozen=True, slots=True)
class OverloadPolicy:
    """Per-state admission by tier (table in the module docstring).

    Attributes:
        shed_retry_after_s: Retry-After of a shed request, >= 1 (default: the default hold
            time, the earliest red can end).
    """

    shed_retry_after_s: int = 5

    def __post_init__(self) -> None:
        if self.shed_retry_after_s < 1:
            raise InvalidParameterError(
                "shed_retry_after_s", f"must be >= 1, got {self.shed_retry_after_s}"
            )

    def admit(self, state: OverloadState, tier: Tier, over_quota: bool) -> OverloadDecision:
        """Decide for a request of a tenant of `tier` that is (or not) over its reservation."""
        borrowing = over_quota or tier is Tier.BEST_EFFORT
        if state is OverloadState.GREEN or not borrowing:
            return OverloadDecision(OverloadAction.ADMIT)
        if state is OverloadState.YELLOW:
            return OverloadDecision(OverloadAction.DEFER)
        return OverloadDecision(OverloadAction.SHED, self.shed_retry_after_s)


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
