"""`LoopProfile`: where the engine loop's time goes, logged at DEBUG every `period_s`.

The engine loop (`EngineLoop`, in a thread or a child process) times its own phases with
`add` (or `mark` then one `lap` per phase): "commands" (handling adds, finishes and calls),
"step" (`EngineDriver.step`: the core step and the expert read), "stats" (snapshots) and
"send" (handing outputs to the front end; the loop writes a step's outputs during the next
step's forward, inside its "runner" time, so "send" counts only writes made outside a
step).
`maybe_log` reads the core's cumulative counters (`StepStats.phase_s`: schedule, runner,
update; steps, decode rows, prefill tokens and chunks, preemptions, wasted prefill tokens),
and the runner's when it keeps them (`ModelRunner.phase_s`: launch, shadow, sync; rows run,
padding included), and, once `period_s` has passed since the last line, logs the averages
per step over that window (preemptions and wasted tokens as window totals), e.g.

    engine loop, last 10.0 s (busy 10.0 s): 312 steps of 32.0 ms: step 28.1 (schedule 1.2,
    runner 24.0 [launch 1.5, shadow 1.8, sync 20.7], update 2.9), commands 1.1, stats 0.5,
    send 2.3; per step 180.0 decodes + 540.0 prefill tokens in 1.5 chunks, 768.0 rows run;
    3 preemptions; 0 prefill tokens of requests shed before their first token

(phase figures in ms per step; "busy" is the loop's time in its phases, so idle time in the
window does not inflate the per-step figures) so an operator, or a benchmark's log, sees
whether steps are bound by the model, by host work or by the server side (`sits serve
--log-level debug` shows it; at INFO a busy server would print a long line every 10 s that
nobody acts on). A line is written
at the first step after `period_s` has passed (a window may span an idle gap); windows
without steps log nothing. Costs a few clock reads per step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sits.core.errors import InvalidParameterError

logger = logging.getLogger(__name__)

LOOP_PHASES = ("commands", "step", "stats", "send")
CORE_PHASES = ("schedule", "runner", "update")
RUNNER_PHASES = ("launch", "shadow", "sync")
DEFAULT_PERIOD_S = 10.0


class LoopProfile:
    """Accumulates loop phase seconds and logs a window summary (module docstring).

    Args:
        core: the `EngineCore` whose counters are read.
        period_s: seconds between log lines, > 0.
        clock: time source (time.monotonic by default).

    Raises:
        InvalidParameterError: period_s <= 0.
    """

    def __init__(
        self,
        core: object,
        period_s: float = DEFAULT_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not period_s > 0:
            raise InvalidParameterError("period_s", f"must be > 0, got {period_s}")
        self.core = core
        self.period_s = period_s
        self._clock = clock
        self._loop_s = dict.fromkeys(LOOP_PHASES, 0.0)
        self._since_s = clock()
        self._mark_s = self._since_s
        self._base = self._core_counters()

    def add(self, phase: str, seconds: float) -> None:
        """Add `seconds` to one of `LOOP_PHASES`."""
        self._loop_s[phase] += seconds

    def mark(self) -> None:
        """Start timing a run of phases (`lap`)."""
        self._mark_s = self._clock()

    def lap(self, phase: str) -> None:
        """Add the time since the last `mark` or `lap` to `phase`, and mark now."""
        now_s = self._clock()
        self._loop_s[phase] += now_s - self._mark_s
        self._mark_s = now_s

    def _core_counters(self) -> dict[str, float]:
        core = self.core
        stats = core.stats  # type: ignore[attr-defined]
        counters = {name: stats.phase_s[name] for name in CORE_PHASES}
        for name in ("num_steps", "num_decode_rows", "num_prefill_tokens", "num_prefill_chunks"):
            counters[name] = getattr(stats, name)
        runner = getattr(core, "runner", None)
        if hasattr(runner, "phase_s"):  # a fake runner (tests, simulations) may keep none
            counters.update(runner.phase_s)  # type: ignore[union-attr]
            counters["rows_run"] = runner.num_rows_run  # type: ignore[union-attr]
        counters["wasted"] = stats.num_wasted_prefill_tokens
        counters["preemptions"] = core.scheduler.num_preemptions  # type: ignore[attr-defined]
        return counters

    def maybe_log(self) -> str | None:
        """Log at DEBUG (and return) the window's line when `period_s` has passed and steps
        ran."""
        now_s = self._clock()
        window_s = now_s - self._since_s
        if window_s < self.period_s:
            return None
        counters = self._core_counters()
        delta = {name: counters[name] - self._base[name] for name in counters}
        loop_s, self._loop_s = self._loop_s, dict.fromkeys(LOOP_PHASES, 0.0)
        self._since_s, self._base = now_s, counters
        steps = int(delta["num_steps"])
        if steps == 0:
            return None
        ms = {name: 1e3 * seconds / steps for name, seconds in {**loop_s, **delta}.items()}
        busy_s = sum(loop_s.values())
        preemptions = int(delta["preemptions"])
        runner, rows = "", ""
        if "rows_run" in delta:
            runner = " [" + ", ".join(f"{n} {ms[n]:.1f}" for n in RUNNER_PHASES) + "]"
            rows = f", {delta['rows_run'] / steps:.1f} rows run"
        line = (
            f"engine loop, last {window_s:.1f} s (busy {busy_s:.1f} s): {_plural(steps, 'step')} "
            f"of {1e3 * busy_s / steps:.1f} ms: step {ms['step']:.1f} (schedule "
            f"{ms['schedule']:.1f}, runner {ms['runner']:.1f}{runner}, update "
            f"{ms['update']:.1f}), commands {ms['commands']:.1f}, stats {ms['stats']:.1f}, "
            f"send {ms['send']:.1f}; per step {delta['num_decode_rows'] / steps:.1f} decodes + "
            f"{delta['num_prefill_tokens'] / steps:.1f} prefill tokens in "
            f"{delta['num_prefill_chunks'] / steps:.1f} chunks{rows}; "
            f"{_plural(preemptions, 'preemption')}; {int(delta['wasted'])} prefill tokens "
            "of requests shed before their first token"
        )
        logger.debug("%s", line)
        return line


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
