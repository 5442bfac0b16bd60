"""`PrecisionState`: which weight set the engine runs, for the runtime precision switch.

A plain, frozen, serialisable message (it crosses the engine process boundary and is shown
by the server): the current set, the sets the engine holds, and the last switch.
`no_switch_state` is the state of an engine without a precision switch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrecisionState:
    """The engine's weight sets (`EngineConfig.precision_switch`).

    Attributes:
        current: the set the steps run from now on: the model dtype's ("bf16", "fp16",
            "fp32") or the twin's ("fp8", "int4").
        available: every set the engine holds, the model dtype's first (one name without a
            precision switch).
        num_switches: switches since start (a request for the current set is not one).
        last_switch_step: the engine step (`StepStats.num_steps` numbering, from 1) that
            first ran in the set of the last switch; None before that step has run.
        last_switch_unix_s: time.time() when the last switch was applied; None before one.
        last_switch_delay_s: seconds from the last switch's call to the launch of the first
            step in its set; None until that step has run.
    """

    current: str
    available: tuple[str, ...]
    num_switches: int = 0
    last_switch_step: int | None = None
    last_switch_unix_s: float | None = None
    last_switch_delay_s: float | None = None


def no_switch_state(precision: str) -> PrecisionState:
    """The state of an engine without a precision switch: its one set, `precision` (the
    runner's, e.g. "bf16")."""
    return PrecisionState(precision, (precision,))
