"""The precision policy: when the overload state asks the engine to switch its weights.

With `--precision-switch` the engine holds two weight sets, the model dtype's ("full") and a
low-precision one ("low": fp8 or int4), and runs one of them per step. The policy
(`--precision-policy`) decides which, from the overload state (`sits.admission.overload`):
- `manual` (the default): never by itself; only the operator switches
  (`POST /v1/admin/precision`);
- `overload`: to low precision once the state has been red for `red_s` seconds without a
  break, back to full precision once it has been green for `green_s` seconds without a break.
  Yellow keeps the current set (and breaks both stretches).

A stretch starts at the first update that sees its state and ends at the first update that
sees another one; it is measured on the injected clock, so the switch comes at the first
update at or after `start + red_s` (or `+ green_s`).

An operator's switch while the policy is on: the operator's choice holds, and the policy
resumes from it: `restart()` starts the current stretch again at the switch, so the policy
overrides the operator only after a full `red_s` (or `green_s`) in the same state counted from
the operator's switch. (An operator who wants the weights fixed starts with `manual`.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from sits.admission.controller import Clock, SystemClock
from sits.admission.overload import OverloadState
from sits.core.errors import InvalidParameterError

# The names of the low-precision weight sets (`--precision-switch`).
LOW_PRECISIONS = frozenset({"fp8", "int4"})


class PrecisionPolicyKind(StrEnum):
    """Who switches the weights' precision (`--precision-policy`)."""

    MANUAL = "manual"  # the operator only
    OVERLOAD = "overload"  # also the overload state (rules in the module docstring)


@dataclass(frozen=True, slots=True)
class PrecisionPolicySettings:
    """The precision policy's options.

    Attributes:
        policy: manual or overload.
        red_s: seconds of red before switching to low precision (`--precision-red-seconds`).
        green_s: seconds of green before switching back (`--precision-green-seconds`).

    Raises:
        InvalidParameterError: `red_s` or `green_s` negative or not finite.
    """

    policy: PrecisionPolicyKind = PrecisionPolicyKind.MANUAL
    red_s: float = 5.0
    green_s: float = 30.0

    def __post_init__(self) -> None:
        for param, value in (
            ("precision_red_seconds", self.red_s),
            ("precision_green_seconds", self.green_s),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise InvalidParameterError(param, f"must be a number of seconds >= 0, got {value}")


def split_precisions(available: tuple[str, ...]) -> tuple[str, str]:
    """(full, low) of an engine's two weight sets (`PrecisionState.available`).

    Raises:
        InvalidParameterError: not two sets, exactly one of them low (`LOW_PRECISIONS`).
    """
    low = [name for name in available if name in LOW_PRECISIONS]
    full = [name for name in available if name not in LOW_PRECISIONS]
    if len(low) != 1 or len(full) != 1:
        raise InvalidParameterError(
            "precision_policy",
            f"needs one full and one low precision ({sorted(LOW_PRECISIONS)}) weight set, "
            f"the engine has {list(available)}",
        )
    return full[0], low[0]


class OverloadPrecisionPolicy:
    """The `overload` policy's state machine (rules in the module docstring).

    Args:
        settings: the red and green times (its `policy` is not read: callers build this class
            only for `overload`).
        full: the name of the full-precision weight set (e.g. "bfloat16").
        low: the name of the low-precision one ("fp8" or "int4").
        clock: time source (default `SystemClock`).
    """

    def __init__(
        self,
        settings: PrecisionPolicySettings,
        full: str,
        low: str,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.full = full
        self.low = low
        self._clock = clock or SystemClock()
        self._state: OverloadState | None = None  # the state of the current stretch
        self._since_s = 0.0  # clock time when the current stretch started

    def decide(self, state: OverloadState, current: str) -> str | None:
        """Feed the overload state now; returns the precision to switch to, or None to stay.

        Args:
            state: the server's overload state now.
            current: the engine's current weight set.
        """
        now_s = self._clock.monotonic()
        if state is not self._state:
            self._state, self._since_s = state, now_s
        held_s = now_s - self._since_s
        if state is OverloadState.RED and current != self.low and held_s >= self.settings.red_s:
            return self.low
        if (
            state is OverloadState.GREEN
            and current != self.full
            and held_s >= self.settings.green_s
        ):
            return self.full
        return None

    def restart(self) -> None:
        """An operator switched the weights: the current stretch starts again now."""
        self._since_s = self._clock.monotonic()
