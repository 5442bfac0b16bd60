"""A token bucket with continuous refill: `capacity` units per `period_s`, at most `capacity`.

Invariants: `level <= capacity` after every call; `level` may go below 0 only through `take`
(a debt, e.g. a request that used more tokens than it reserved), and refills pay it back first.
Time comes in as an argument (seconds on the caller's monotonic clock), so the bucket is a pure
state machine. Refill and waits are computed as `elapsed * capacity / period_s` and
`deficit * period_s / capacity` so that round limits give exact results (2 per minute: one unit
every 30.0 s). Comparisons allow `EPS_UNITS` of float error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

EPS_UNITS = 1e-6


@dataclass(slots=True)
class TokenBucket:
    """Rate limiter state for one limit (requests or tokens of one tenant).

    Attributes:
        capacity: most units the bucket holds (= the limit per period), > 0.
        period_s: seconds to refill from empty to full, > 0 (60 for per-minute limits).
        level: units available now (may be negative: a debt).
        updated_s: clock time of the last refill, in seconds.
    """

    capacity: float
    period_s: float
    level: float
    updated_s: float

    @classmethod
    def full(cls, capacity: float, period_s: float, now_s: float) -> TokenBucket:
        """A full bucket.

        Raises:
            ValueError: capacity or period_s is not > 0.
        """
        if not (capacity > 0 and period_s > 0):
            raise ValueError(f"capacity and period_s must be > 0, got {capacity}, {period_s}")
        return cls(float(capacity), float(period_s), float(capacity), now_s)

    def refill(self, now_s: float) -> None:
        """Add what accrued since the last refill (times before `updated_s` add nothing)."""
        elapsed_s = now_s - self.updated_s
        if elapsed_s > 0:
            gained = elapsed_s * self.capacity / self.period_s
            self.level = min(self.capacity, self.level + gained)
            self.updated_s = now_s

    def available(self, now_s: float) -> float:
        """Units available at `now_s` (after refill)."""
        self.refill(now_s)
        return self.level

    def seconds_until(self, amount: float, now_s: float) -> float:
        """Seconds from `now_s` until `amount` units are available: 0 if they are now,
        `math.inf` if `amount` exceeds the capacity."""
        self.refill(now_s)
        deficit = amount - self.level
        if deficit <= EPS_UNITS:
            return 0.0
        if amount > self.capacity + EPS_UNITS:
            return math.inf
        return deficit * self.period_s / self.capacity

    def seconds_until_full(self, now_s: float) -> float:
        """Seconds from `now_s` until the bucket is full again (the "reset" time)."""
        return self.seconds_until(self.capacity, now_s)

    def try_take(self, amount: float, now_s: float) -> bool:
        """Take `amount` units if available now; on False nothing changes (but the refill)."""
        if self.seconds_until(amount, now_s) > 0:
            return False
        self.level -= amount
        return True

    def take(self, amount: float, now_s: float) -> None:
        """Take `amount` units unconditionally (the level may go negative: a debt)."""
        self.refill(now_s)
        self.level -= amount

    def give_back(self, amount: float, now_s: float) -> None:
        """Return `amount` unused units (capped at capacity)."""
        self.refill(now_s)
        self.level = min(self.capacity, self.level + amount)
