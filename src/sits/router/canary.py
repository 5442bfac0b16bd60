"""Canary rollout with automatic promotion and rollback.

Replicas labelled "canary" get a share `weight` of the traffic (`pick_canary`); the rest goes to
the stable ones. The router reports every finished request (`record`) and calls `evaluate`
after each request and on a timer. Rules (numbers in `CanaryConfig`, time in seconds from the
injected clock):
- INACTIVE (no canary replica) -> RAMPING at `initial_weight` when a canary replica is present;
  RAMPING -> INACTIVE (weight 0) when none is left.
- Evidence: per side (canary, stable), the requests of the last `window_s` seconds recorded
  since the last weight change; a decision needs >= `min_samples` requests on both sides.
- Bounds: canary P95 TTFT <= stable P95 TTFT * `max_ttft_p95_ratio` + `latency_slack_s`, the
  same for TPOT with `max_tpot_p95_ratio`, and canary error rate <= stable error rate +
  `max_error_rate_delta`. A latency bound is checked when both sides have a sample of it.
- A broken bound rolls back at once: weight 0, ROLLED_BACK.
- Within every bound and `step_hold_s` after the last change: the weight steps up to the next
  of `steps` above it; reaching 1.0 is PROMOTED.
- PROMOTED and ROLLED_BACK stay until `reset()` (a new canary) starts over.
The seeds gate a canary on P95 latency as here; none of them promotes automatically.
Not thread-safe (the router uses it from one event loop).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from sits.admission import Clock
from sits.core.errors import InvalidParameterError
from sits.router.predictor import LatencyWindow

logger = logging.getLogger(__name__)

MAX_HISTORY = 100  # decisions kept for GET /v1/router/canary


@dataclass(frozen=True, slots=True)
class CanaryConfig:
    """Canary rollout limits.

    Attributes:
        initial_weight: the canary's share of traffic at the start, in (0, 1].
        steps: the shares it climbs through, strictly increasing in (0, 1], ending at 1.0.
        window_s: the sliding window of evidence, seconds, > 0.
        min_samples: requests needed on each side for a decision, >= 1.
        step_hold_s: time at one weight, with enough samples, before stepping up, seconds, >= 0.
        max_ttft_p95_ratio: canary P95 TTFT may be this many times stable's (plus slack), >= 1.
        max_tpot_p95_ratio: the same for P95 TPOT, >= 1.
        latency_slack_s: absolute slack added to both latency bounds so that tiny latencies do
            not flap, seconds, >= 0.
        max_error_rate_delta: canary error rate may exceed stable's by this much, in [0, 1].

    Raises:
        InvalidParameterError: a value out of range (its `param` names the field).
    """

    initial_weight: float = 0.05
    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    window_s: float = 60.0
    min_samples: int = 20
    step_hold_s: float = 30.0
    max_ttft_p95_ratio: float = 1.5
    max_tpot_p95_ratio: float = 1.5
    latency_slack_s: float = 0.05
    max_error_rate_delta: float = 0.05

    def __post_init__(self) -> None:
        if not 0 < self.initial_weight <= 1:
            raise InvalidParameterError(
                "initial_weight", f"must be in (0, 1]: {self.initial_weight}"
            )
        steps = tuple(self.steps)
        object.__setattr__(self, "steps", steps)
        if not steps or steps[-1] != 1.0:
            raise InvalidParameterError("steps", f"must end at 1.0: {steps}")
        if any(not 0 < s <= 1 for s in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            raise InvalidParameterError("steps", f"must increase strictly in (0, 1]: {steps}")
        if not self.window_s > 0:
            raise InvalidParameterError("window_s", f"must be > 0: {self.window_s}")
        if self.min_samples < 1:
            raise InvalidParameterError("min_samples", f"must be >= 1: {self.min_samples}")
        for name in ("step_hold_s", "latency_slack_s"):
            if not getattr(self, name) >= 0:
                raise InvalidParameterError(name, f"must be >= 0: {getattr(self, name)}")
        for name in ("max_ttft_p95_ratio", "max_tpot_p95_ratio"):
            if not getattr(self, name) >= 1:
                raise InvalidParameterError(name, f"must be >= 1: {getattr(self, name)}")
        if not 0 <= self.max_error_rate_delta <= 1:
            raise InvalidParameterError(
                "max_error_rate_delta", f"must be in [0, 1]: {self.max_error_rate_delta}"
            )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this config."""
        body = asdict(self)
        body["steps"] = list(self.steps)
        return body


class CanaryState(StrEnum):
    """Where the rollout stands."""

    INACTIVE = "inactive"  # no canary replica
    RAMPING = "ramping"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"


@dataclass(frozen=True, slots=True)
class CanaryDecision:
    """One change of the canary's weight.

    Attributes:
        time_s: clock time of the decision, seconds.
        from_weight, to_weight: the share before and after, 0..1.
        state: the state after the decision.
        reason: why, with the figures compared.
    """

    time_s: float
    from_weight: float
    to_weight: float
    state: CanaryState
    reason: str

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this decision."""
        body = asdict(self)
        body["state"] = str(self.state)
        return body


@dataclass(frozen=True, slots=True)
class SideStats:
    """One side's evidence now: requests, P95 TTFT and TPOT (seconds or None), error rate."""

    count: int
    ttft_p95_s: float | None
    tpot_p95_s: float | None
    error_rate: float | None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of these figures."""
        return asdict(self)


class _Side:
    """The windows of one side: outcomes (1.0 = failed), TTFTs and TPOTs."""

    __slots__ = ("outcomes", "tpot", "ttft")

    def __init__(self, clock: Clock, window_s: float) -> None:
        self.outcomes = LatencyWindow(clock, window_s, max_samples=10_000)
        self.ttft = LatencyWindow(clock, window_s, max_samples=10_000)
        self.tpot = LatencyWindow(clock, window_s, max_samples=10_000)

    def stats(self) -> SideStats:
        return SideStats(
            count=self.outcomes.count(),
            ttft_p95_s=self.ttft.percentile(95),
            tpot_p95_s=self.tpot.percentile(95),
            error_rate=self.outcomes.mean(),
        )

    def clear(self) -> None:
        for window in (self.outcomes, self.ttft, self.tpot):
            window.clear()


class CanaryController:
    """The rollout (rules in the module docstring).

    Args:
        config: limits (default `CanaryConfig()`: 5 -> 25 -> 50 -> 100 %, 20 requests a side,
            30 s per step, P95s within 1.5 x + 50 ms, errors within +5 points).
        clock: time source (`monotonic()` seconds).
    """

    def __init__(self, config: CanaryConfig | None, clock: Clock) -> None:
        self.config = config or CanaryConfig()
        self._clock = clock
        self._canary = _Side(clock, self.config.window_s)
        self._stable = _Side(clock, self.config.window_s)
        self._state = CanaryState.INACTIVE
        self._weight = 0.0
        self._changed_s = clock.monotonic()
        self._history: list[CanaryDecision] = []

    @property
    def weight(self) -> float:
        """The canary's share of traffic now, 0..1 (0 unless RAMPING or PROMOTED)."""
        return self._weight

    @property
    def state(self) -> CanaryState:
        """The rollout's state now."""
        return self._state

    @property
    def history(self) -> list[CanaryDecision]:
        """The decisions made, oldest first (the last `MAX_HISTORY`)."""
        return list(self._history)

    def record(
        self, is_canary: bool, ttft_s: float | None, tpot_s: float | None, failed: bool
    ) -> None:
        """Report one finished request.

        Args:
            is_canary: it was served by a canary replica.
            ttft_s: its time to first token, seconds (None: no token came).
            tpot_s: its mean time per output token after the first, seconds (None: <= 1 token).
            failed: it ended in an error the replica is to blame for (5xx, reset, time-out).

        Raises:
            InvalidParameterError: a negative or non-finite latency.
        """
        side = self._canary if is_canary else self._stable
        if ttft_s is not None:
            side.ttft.add(ttft_s)
        if tpot_s is not None:
            side.tpot.add(tpot_s)
        side.outcomes.add(1.0 if failed else 0.0)

    def evaluate(self, canary_present: bool) -> CanaryDecision | None:
        """Apply the rules now.

        Args:
            canary_present: at least one canary replica is routable.

        Returns:
            The decision made now, or None when nothing changed.
        """
        state = self._state
        if not canary_present:
            if state is CanaryState.RAMPING:
                return self._change(0.0, CanaryState.INACTIVE, "no canary replica left")
            return None
        if state is CanaryState.INACTIVE:
            reason = f"canary replica present: start at {_pct(self.config.initial_weight)}"
            return self._change(self.config.initial_weight, CanaryState.RAMPING, reason)
        if state is not CanaryState.RAMPING:
            return None
        canary, stable = self._canary.stats(), self._stable.stats()
        if min(canary.count, stable.count) < self.config.min_samples:
            return None
        broken = self._broken_bounds(canary, stable)
        if broken:
            return self._change(0.0, CanaryState.ROLLED_BACK, "rollback: " + "; ".join(broken))
        if self._clock.monotonic() - self._changed_s < self.config.step_hold_s:
            return None
        to_weight = next((s for s in self.config.steps if s > self._weight), 1.0)
        to_state = CanaryState.PROMOTED if to_weight >= 1.0 else CanaryState.RAMPING
        reason = (
            f"within bounds over {canary.count} canary / {stable.count} stable requests "
            f"({_figures(canary, stable)}): {_pct(self._weight)} -> {_pct(to_weight)}"
        )
        return self._change(to_weight, to_state, reason)

    def snapshot(self) -> dict[str, Any]:
        """JSON for GET /v1/router/canary: state, weight, config, each side's window figures
        and the history (each decision's `time_s` on the router's monotonic clock and its
        `age_s`, seconds ago)."""
        return {
            "state": str(self._state),
            "weight": self._weight,
            "config": self.config.to_json(),
            "windows": {
                "canary": self._canary.stats().to_json(),
                "stable": self._stable.stats().to_json(),
            },
            "history": [
                {**d.to_json(), "age_s": self._clock.monotonic() - d.time_s} for d in self._history
            ],
        }

    def side_stats(self, is_canary: bool) -> SideStats:
        """One side's evidence now (what `evaluate` compares)."""
        return (self._canary if is_canary else self._stable).stats()

    def reset(self) -> None:
        """Start over (a new canary after a promotion or rollback): INACTIVE, weight 0, windows
        empty; the next `evaluate(True)` starts at `initial_weight`. The history stays."""
        self._state = CanaryState.INACTIVE
        self._weight = 0.0
        self._changed_s = self._clock.monotonic()
        self._canary.clear()
        self._stable.clear()

    def _broken_bounds(self, canary: SideStats, stable: SideStats) -> list[str]:
        cfg = self.config
        out = []
        for name, c_s, s_s, ratio in (
            ("ttft", canary.ttft_p95_s, stable.ttft_p95_s, cfg.max_ttft_p95_ratio),
            ("tpot", canary.tpot_p95_s, stable.tpot_p95_s, cfg.max_tpot_p95_ratio),
        ):
            if c_s is not None and s_s is not None and c_s > s_s * ratio + cfg.latency_slack_s:
                out.append(
                    f"canary {name} p95 {c_s:.3f} s > {ratio:g} x stable {s_s:.3f} s"
                    f" + {cfg.latency_slack_s:.3f} s"
                )
        c_err, s_err = canary.error_rate or 0.0, stable.error_rate or 0.0
        if c_err - s_err > cfg.max_error_rate_delta + 1e-12:
            out.append(
                f"canary error rate {c_err:.3f} > stable {s_err:.3f}"
                f" + {cfg.max_error_rate_delta:.3f}"
            )
        return out

    def _change(self, to_weight: float, to_state: CanaryState, reason: str) -> CanaryDecision:
        now_s = self._clock.monotonic()
        decision = CanaryDecision(now_s, self._weight, to_weight, to_state, reason)
        self._weight, self._state, self._changed_s = to_weight, to_state, now_s
        self._canary.clear()
        self._stable.clear()
        self._history = [*self._history[-(MAX_HISTORY - 1) :], decision]
        return decision


def log_canary(decision: CanaryDecision) -> None:
    """Log a decision: a rollback at WARNING (an operator acts on it), a step at INFO."""
    level = logging.WARNING if decision.state is CanaryState.ROLLED_BACK else logging.INFO
    logger.log(level, "canary %s -> %s: %s", _pct(decision.from_weight), _pct(decision.to_weight),
               decision.reason)  # fmt: skip


def pick_canary(weight: float, u: float) -> bool:
    """Send this request to a canary replica? True when `u` < `weight`.

    Args:
        weight: the canary's share, 0..1 (`CanaryController.weight`).
        u: a uniform draw in [0, 1) from the router's injected random source.

    Raises:
        InvalidParameterError: `weight` outside [0, 1] or `u` outside [0, 1).
    """
    if not 0 <= weight <= 1:
        raise InvalidParameterError("weight", f"must be in [0, 1]: {weight}")
    if not 0 <= u < 1:
        raise InvalidParameterError("u", f"must be in [0, 1): {u}")
    return u < weight


def _pct(weight: float) -> str:
    return f"{weight * 100:g} %"


def _figures(canary: SideStats, stable: SideStats) -> str:
    def sec(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    return (
        f"ttft p95 {sec(canary.ttft_p95_s)} vs {sec(stable.ttft_p95_s)}, "
        f"tpot p95 {sec(canary.tpot_p95_s)} vs {sec(stable.tpot_p95_s)}, "
        f"errors {rate(canary.error_rate)} vs {rate(stable.error_rate)}"
    )
