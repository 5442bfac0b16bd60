"""Engine health: when a silent engine loop counts as hung.

A loop that has sent nothing for a while is either inside one long step or hung. The two differ
in how long they may last: one step (a big prompt chunk on a CPU, a process starved of CPU)
may run for minutes, while between steps the loop turns every fraction of a second, idle or
not. So the front ends (`AsyncLLM`, `AsyncMPLLM`) track when the running step started and when
the loop last turned, and `hung_loop_error` applies a bound to each.

Imports nothing heavy: the CLI reads `ENGINE_STEP_TIMEOUT_S` for its flag's default.
"""

from __future__ import annotations

from sits.core.errors import EngineDeadError

ENGINE_STEP_TIMEOUT_S = 60.0  # as vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S


def hung_loop_error(
    now_s: float,
    turned_s: float,
    step_started_s: float | None,
    health_timeout_s: float,
    step_timeout_s: float,
) -> EngineDeadError | None:
    """Why an engine loop counts as hung, or None while it is live.

    Inside a step the loop is live until the step has run `step_timeout_s`: one long step (a
    big prompt chunk on a CPU, a starved process) is not a hung loop. Between steps it must
    turn within `health_timeout_s` (an idle loop turns every fraction of a second).

    Args:
        now_s, turned_s, step_started_s: time.monotonic() now, when the loop last turned (or
            last reported), and when the running step started (None between steps).
        health_timeout_s, step_timeout_s: the two bounds, seconds.
    """
    if step_started_s is not None:
        if now_s - step_started_s < step_timeout_s:
            return None
        digits = 1 if step_timeout_s >= 1 else 4  # a sub-second timeout: show its scale
        return EngineDeadError(
            f"an engine step has run for {now_s - step_started_s:.{digits}f} s, over the step "
            f"timeout of {step_timeout_s:g} s (--engine-step-timeout)"
        )
    if now_s - turned_s < health_timeout_s:
        return None
    return EngineDeadError(
        f"the engine loop has not turned for {now_s - turned_s:.1f} s between steps "
        f"(health timeout {health_timeout_s:g} s)"
    )
