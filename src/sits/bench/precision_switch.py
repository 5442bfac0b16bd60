"""`sits bench precision-switch`: the runtime precision switch under load (issue 25).

An `AsyncLLM` started with `--precision-switch fp8|int4` serves `--num-prompts` requests of
`--input-len` random token ids, each generating exactly `--output-len` tokens (greedy,
`ignore_eos`), all at once or at `--request-rate` (Poisson, seeded). A second asyncio task
flips the weight set `--num-switches` times through `AsyncLLM.set_precision`, as the admin
route does: the model dtype's set <-> the twin, each switch once `--switch-every-steps`
engine steps (default 20) have run in the current set (the first: from the load's first
step), or `--switch-every-s` seconds after the previous call (the first: after the load's
first step); it stops early only when every request has finished.

Each step the engine runs is recorded on the engine thread (`PrecisionStepRecorder`, which
wraps `Stepper.mark_run` and `account_step` of the benchmark's own engine): when it was run
or launched, when its update ended, its weight set and switch count (the engine's stamp) and
its output tokens. From those records (pure functions, tested with hand-made records):
- a switch's delay (`switch_delays`): from the call (time.monotonic() just before
  `set_precision`) to the launch of the first step stamped with its switch count, in seconds,
  and in steps: the steps launched after the call that still ran in the old set (target: 0,
  i.e. "< 1 step"); None when no step ran in its set (the load ended, or the next switch
  came first);
- periods (`precision_periods`): the steps between two switches all run in one set; a
  period's output tok/s = its steps' output tokens / (end of its last step - end of the
  previous period's last step; the first period from its first launch). Per switch, the
  period before and after it; per precision, the interior periods only (both ends a switch:
  the first holds the prompts' prefill, the last the load's tail), all periods when there is
  no interior one.
A request fails when it raises, or finishes with another reason than "length" or another
token count than `--output-len` (truncated); the target is 0. The exit code is 1 when a
request failed or fewer switches were made than asked, else 0.

JSON (`--output-json`, schema "sits.bench.precision_switch/1"): the `base_doc` head plus
"workload", "precisions" (model dtype's set, twin), "num_switches_requested",
"num_switches_made", "switches" (per switch: "index", "precision", "delay_ms",
"delay_steps", "first_step", "before_tokens_per_s", "after_tokens_per_s"), "periods" (per
period: "precision", "num_steps", "num_output_tokens", "duration_s", "tokens_per_s",
"interior"), "per_precision" ({precision: {"tokens_per_s", "num_periods",
"num_output_tokens", "duration_s"}}), "requests" ({"num_requests", "num_failed",
"num_truncated", "num_output_tokens", "errors" (first few), "max_precision_switches"}),
"output_tokens_per_s" (the whole load), "max_delay_steps", "delay_target_met".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sits.bench.metrics import percentile
from sits.bench.offline_common import (
    add_offline_args,
    base_doc,
    header_lines,
    markdown_table,
    offline_setup,
    random_prompts,
    write_json,
)
from sits.bench.report import command_line
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import RequestOutputKind, SamplingParams

SCHEMA = "sits.bench.precision_switch/1"
DESCRIPTION = (
    "The precision switch under load: flip the weight set --num-switches times through "
    "AsyncLLM.set_precision while --num-prompts requests run; per switch the delay from the "
    "call to the first step in the new set (ms and steps, target < 1 step), output tok/s "
    "before and after it and per precision, and the failed or truncated requests (target 0)."
)
DEFAULT_SWITCH_EVERY_STEPS = 20
_POLL_S = 0.002  # the switcher's wait granularity (the delay is measured from the call)
_MAX_ERRORS_KEPT = 5


def add_precision_switch_args(p: argparse.ArgumentParser) -> None:
    """Add the `sits bench precision-switch` flags (the engine flags included)."""
    add_offline_args(p, input_len=128, output_len=256)
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the load (64)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (seeded by --seed); inf (default): all at once",
    )
    p.add_argument("--num-switches", type=int, default=10, help="precision switches (10)")
    every = p.add_mutually_exclusive_group()
    every.add_argument(
        "--switch-every-steps",
        type=int,
        default=DEFAULT_SWITCH_EVERY_STEPS,
        help=f"engine steps between switches (default {DEFAULT_SWITCH_EVERY_STEPS})",
    )
    every.add_argument(
        "--switch-every-s",
        type=float,
        default=None,
        help="seconds between switches (instead of --switch-every-steps)",
    )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One non-empty engine step.

    Attributes:
        launched_s: time.monotonic() when it was run (synchronous) or launched (async
            scheduling), i.e. when the engine stamped its weight set.
        ended_s: time.monotonic() when its update and accounting ended.
        precision: the weight set it ran.
        num_switches: the engine's switch count when it was launched.
        num_output_tokens: tokens it sampled.
    """

    launched_s: float
    ended_s: float
    precision: str
    num_switches: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class SwitchCall:
    """One `set_precision` call.

    Attributes:
        called_s: time.monotonic() just before the call.
        precision: the set asked for.
        num_switches: the engine's switch count the call returned (its own number).
    """

    called_s: float
    precision: str
    num_switches: int


@dataclass(frozen=True, slots=True)
class SwitchDelay:
    """How long a switch took to reach a step.

    Attributes:
        precision: the set switched to.
        first_step: index (into the step records) of the first step in its set; None when
            none ran (then the delays are None too).
        delay_s: first step's launch - the call, seconds.
        delay_steps: steps launched at or after the call that still ran in the old set.
    """

    precision: str
    first_step: int | None
    delay_s: float | None
    delay_steps: int | None


@dataclass(frozen=True, slots=True)
class Period:
    """The steps between two switches (one weight set).

    Attributes:
        precision: their set.
        num_switches: their switch count.
        num_steps, num_output_tokens: steps and tokens in it.
        duration_s: end of its last step - end of the previous period's last step (the first
            period: from its first step's launch).
        interior: a switch began it and another ended it.
    """

    precision: str
    num_switches: int
    num_steps: int
    num_output_tokens: int
    duration_s: float
    interior: bool

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_output_tokens / self.duration_s if self.duration_s > 0 else None


def switch_delays(steps: Sequence[StepRecord], calls: Sequence[SwitchCall]) -> list[SwitchDelay]:
    """Each call's delay to its first step (see `SwitchDelay`).

    Args:
        steps: the step records in launch order (their switch counts never decrease).
        calls: the switch calls in call order.

    Returns:
        One `SwitchDelay` per call, in order.
    """
    delays = []
    for call in calls:
        first = next((i for i, s in enumerate(steps) if s.num_switches >= call.num_switches), None)
        if first is None or steps[first].num_switches != call.num_switches:
            delays.append(SwitchDelay(call.precision, None, None, None))  # never ran in its set
            continue
        assert steps[first].precision == call.precision, (steps[first], call)
        in_between = sum(1 for s in steps[:first] if s.launched_s >= call.called_s)
        delay_s = steps[first].launched_s - call.called_s
        delays.append(SwitchDelay(call.precision, first, delay_s, in_between))
    return delays


def precision_periods(steps: Sequence[StepRecord]) -> list[Period]:
    """The step records cut into runs of one switch count (see `Period`), in order."""
    periods: list[Period] = []
    start = 0
    while start < len(steps):
        end = start
        while end < len(steps) and steps[end].num_switches == steps[start].num_switches:
            end += 1
        begin_s = steps[start - 1].ended_s if start else steps[0].launched_s
        run = steps[start:end]
        periods.append(
            Period(
                precision=run[0].precision,
                num_switches=run[0].num_switches,
                num_steps=len(run),
                num_output_tokens=sum(s.num_output_tokens for s in run),
                duration_s=run[-1].ended_s - begin_s,
                interior=bool(start) and end < len(steps),
            )
        )
        start = end
    return periods


def per_precision(periods: Sequence[Period]) -> dict[str, dict[str, Any]]:
    """Output tok/s of each set over its interior periods (all of its periods when it has no
    interior one): {precision: {"tokens_per_s", "num_periods", "num_output_tokens",
    "duration_s"}}."""
    result = {}
    for name in dict.fromkeys(p.precision for p in periods):
        own = [p for p in periods if p.precision == name]
        chosen = [p for p in own if p.interior] or own
        tokens = sum(p.num_output_tokens for p in chosen)
        duration_s = sum(p.duration_s for p in chosen)
        result[name] = {
            "tokens_per_s": tokens / duration_s if duration_s > 0 else None,
            "num_periods": len(chosen),
            "num_output_tokens": tokens,
            "duration_s": duration_s,
        }
    return result


class PrecisionStepRecorder:
    """Records a `StepRecord` for every non-empty step of one engine core (engine thread).

    Attributes:
        steps: the records, in launch order (appended when each step's accounting ends).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.steps: list[StepRecord] = []
        self._launched_s: dict[int, float] = {}  # id(PlannedStep) -> launch time

    def attach(self, core: Any) -> PrecisionStepRecorder:
        """Wrap `mark_run` and `account_step` of the step path (`core.stepper`, an `EngineCore`
        with a precision switch, owned by the benchmark) on that object; returns self."""
        stepper = core.stepper
        mark_run: Callable[..., Any] = stepper.mark_run
        account_step: Callable[..., Any] = stepper.account_step

        def recording_mark_run(planned: Any) -> None:
            if planned.plan.scheduled:
                self._launched_s[id(planned)] = self.clock()
            mark_run(planned)

        def recording_account_step(planned: Any, *args: Any) -> Any:
            outputs = account_step(planned, *args)
            launched_s = self._launched_s.pop(id(planned), None)
            if launched_s is not None:
                stamp = planned.precision
                num_tokens = sum(len(out.new_token_ids) for out in outputs)
                self.steps.append(
                    StepRecord(launched_s, self.clock(), stamp.precision, stamp.num_switches,
                               num_tokens)
                )  # fmt: skip
            return outputs

        stepper.mark_run = recording_mark_run
        stepper.account_step = recording_account_step
        return self


@dataclass(slots=True)
class LoadResult:
    """What the load and the switcher saw (asyncio side).

    Attributes:
        calls: the switch calls made.
        num_output_tokens: per finished request, its tokens.
        num_failed: requests that raised; errors: the first few messages.
        num_truncated: requests that finished early or with another reason than "length".
        max_precision_switches: the most switches one request ran across.
    """

    calls: list[SwitchCall] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    num_failed: int = 0
    num_truncated: int = 0
    errors: list[str] = field(default_factory=list)
    max_precision_switches: int = 0


async def _one_request(
    engine: Any, request_id: str, prompt: list[int], delay_s: float, output_len: int,
    result: LoadResult,
) -> None:  # fmt: skip
    """Send one request after `delay_s` and record how it ended."""
    await asyncio.sleep(delay_s)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=output_len,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    final = None
    try:
        async for out in engine.generate(request_id, prompt, params):
            final = out
    except Exception as exc:  # noqa: BLE001 - a failed request is a measured outcome
        result.num_failed += 1
        if len(result.errors) < _MAX_ERRORS_KEPT:
            result.errors.append(f"{request_id}: {exc!r}")
        return
    completion = final.outputs[0] if final is not None else None
    if completion is None:
        result.num_truncated += 1
        return
    result.num_output_tokens.append(len(completion.token_ids))
    if completion.finish_reason != "length" or len(completion.token_ids) != output_len:
        result.num_truncated += 1
    result.max_precision_switches = max(result.max_precision_switches, final.num_precision_switches)


async def _switcher(
    engine: Any, recorder: PrecisionStepRecorder, args: argparse.Namespace,
    load_done: asyncio.Event, result: LoadResult,
) -> None:  # fmt: skip
    """Flip the weight set `args.num_switches` times (module docstring); stops when the load
    is done."""
    every_steps = args.switch_every_steps if args.switch_every_s is None else None
    full, twin = engine.precision_state().available[:2]

    async def wait(until: Callable[[], bool]) -> bool:
        while not until():
            if load_done.is_set():
                return False
            await asyncio.sleep(_POLL_S)
        return not load_done.is_set()

    steps = recorder.steps
    num_switches = engine.precision_state().num_switches
    since, since_s = 0, 0.0  # the current set's steps start at or after steps[since]

    def due() -> bool:
        if every_steps is None:
            return time.monotonic() >= since_s + args.switch_every_s
        return sum(1 for s in steps[since:] if s.num_switches >= num_switches) >= every_steps

    if not await wait(lambda: bool(steps)):
        return
    since_s = time.monotonic()
    for _ in range(args.num_switches):
        if not await wait(due):
            return
        target = twin if engine.precision_state().current == full else full
        since, since_s = len(steps), time.monotonic()
        state = await engine.set_precision(target)
        num_switches = state.num_switches
        result.calls.append(SwitchCall(since_s, target, num_switches))


async def run_load(
    engine: Any, recorder: PrecisionStepRecorder, args: argparse.Namespace,
    prompts: list[list[int]],
) -> LoadResult:  # fmt: skip
    """Run the requests and the switcher together on `engine` (an `AsyncLLM` whose core the
    recorder is attached to); returns what they saw."""
    result = LoadResult()
    rng = random.Random(args.seed)
    arrival_s, offsets = 0.0, []
    for _ in prompts:
        offsets.append(arrival_s)
        if args.request_rate != float("inf"):
            arrival_s += rng.expovariate(args.request_rate)
    load_done = asyncio.Event()
    switcher = asyncio.create_task(_switcher(engine, recorder, args, load_done, result))
    await asyncio.gather(
        *(
            _one_request(engine, f"ps-{i}", prompt, offsets[i], args.output_len, result)
            for i, prompt in enumerate(prompts)
        )
    )
    load_done.set()
    await switcher
    return result


def _check_args(args: argparse.Namespace) -> None:
    """Raises InvalidParameterError for a flag out of range."""
    if args.precision_switch is None:
        raise InvalidParameterError(
            "precision_switch", "give --precision-switch fp8 or int4 (the set to switch to)"
        )
    if args.num_prompts < 1 or args.num_switches < 1:
        raise InvalidParameterError("num_prompts", "--num-prompts and --num-switches must be >= 1")
    if not args.request_rate > 0:
        raise InvalidParameterError("request_rate", "--request-rate must be > 0")
    if args.switch_every_steps < 1:
        raise InvalidParameterError("switch_every_steps", "--switch-every-steps must be >= 1")
    if args.switch_every_s is not None and not args.switch_every_s > 0:
        raise InvalidParameterError("switch_every_s", "--switch-every-s must be > 0")


def run_precision_switch_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark of the parsed flags; returns the result document (module docstring).

    Raises:
        InvalidParameterError: bad flags.
    """
    _check_args(args)
    setup = offline_setup(args)
    prompts = random_prompts(args.num_prompts, args.input_len, setup.vocab_size, args.seed)
    engine, steps, result = asyncio.run(_serve(setup.config, args, prompts))
    return precision_switch_doc(args, setup, engine, steps, result)


async def _serve(
    config: Any, args: argparse.Namespace, prompts: list[list[int]]
) -> tuple[Any, list[StepRecord], LoadResult]:
    """Start an `AsyncLLM` of `config`, run the load on it, shut it down."""
    from sits.engine.async_llm import AsyncLLM  # torch: imported on use

    engine = AsyncLLM(config)
    try:
        recorder = PrecisionStepRecorder().attach(engine.engine_core)
        result = await run_load(engine, recorder, args, prompts)
    finally:
        await engine.shutdown()
    return engine, recorder.steps, result


def precision_switch_doc(
    args: argparse.Namespace, setup: Any, engine: Any, steps: list[StepRecord], result: LoadResult
) -> dict[str, Any]:
    """The result document of a run (module docstring)."""
    delays = switch_delays(steps, result.calls)
    periods = precision_periods(steps)
    by_count = {p.num_switches: p for p in periods}
    doc = base_doc(SCHEMA, setup, engine)
    doc["workload"] = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "switch_every_steps": args.switch_every_steps if args.switch_every_s is None else None,
        "switch_every_s": args.switch_every_s,
        "sampling": "greedy, ignore_eos",
        "seed": args.seed,
    }
    doc["precisions"] = list(engine.precision_state().available)
    doc["num_switches_requested"] = args.num_switches
    doc["num_switches_made"] = len(result.calls)
    doc["switches"] = []
    for i, (call, delay) in enumerate(zip(result.calls, delays, strict=True)):
        before = by_count.get(call.num_switches - 1)
        after = by_count.get(call.num_switches)
        doc["switches"].append(
            {
                "index": i + 1,
                "precision": call.precision,
                "delay_ms": None if delay.delay_s is None else delay.delay_s * 1e3,
                "delay_steps": delay.delay_steps,
                "first_step": delay.first_step,
                "before_tokens_per_s": None if before is None else before.tokens_per_s,
                "after_tokens_per_s": None if after is None else after.tokens_per_s,
            }
        )
    doc["periods"] = [{**dataclasses.asdict(p), "tokens_per_s": p.tokens_per_s} for p in periods]
    doc["per_precision"] = per_precision(periods)
    doc["requests"] = {
        "num_requests": args.num_prompts,
        "num_failed": result.num_failed,
        "num_truncated": result.num_truncated,
        "num_output_tokens": sum(result.num_output_tokens),
        "errors": result.errors,
        "max_precision_switches": result.max_precision_switches,
    }
    span_s = steps[-1].ended_s - steps[0].launched_s if steps else 0.0
    total_tokens = sum(s.num_output_tokens for s in steps)
    doc["output_tokens_per_s"] = total_tokens / span_s if span_s > 0 else None
    measured = [d.delay_steps for d in delays if d.delay_steps is not None]
    doc["max_delay_steps"] = max(measured) if measured else None
    doc["delay_target_met"] = bool(measured) and len(measured) == len(delays) and max(measured) < 1
    return doc


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_precision_switch(doc: dict[str, Any], with_command: bool = True) -> str:
    """The printed report: command (unless `with_command` is False: printed already), machine,
    model and workload, the per-precision and per-switch markdown tables, a summary line."""
    w, req = doc["workload"], doc["requests"]
    every = (
        f"every {w['switch_every_steps']} steps"
        if w["switch_every_steps"] is not None
        else f"every {w['switch_every_s']} s"
    )
    rate = "all at once" if w["request_rate"] is None else f"{w['request_rate']} req/s"
    lines = header_lines(doc, with_command)
    lines.append(
        f"Workload: {w['num_prompts']} x {w['input_len']} in / {w['output_len']} out "
        f"({w['sampling']}, {rate}); {doc['num_switches_requested']} switches "
        f"{' <-> '.join(doc['precisions'])} {every}"
    )
    lines.append("")
    rows = [
        [name, _fmt(d["tokens_per_s"]), str(d["num_periods"]), str(d["num_output_tokens"]),
         _fmt(d["duration_s"], 3)]
        for name, d in doc["per_precision"].items()
    ]  # fmt: skip
    lines += markdown_table(
        ["precision", "output tok/s", "periods", "output tokens", "seconds"], rows
    )
    lines.append("")
    rows = [
        [str(s["index"]), s["precision"], _fmt(s["delay_ms"], 3),
         "-" if s["delay_steps"] is None else str(s["delay_steps"]),
         _fmt(s["before_tokens_per_s"]), _fmt(s["after_tokens_per_s"])]
        for s in doc["switches"]
    ]  # fmt: skip
    lines += markdown_table(
        ["switch", "to", "delay ms", "delay steps", "tok/s before", "tok/s after"], rows
    )
    delays_ms = sorted(s["delay_ms"] for s in doc["switches"] if s["delay_ms"] is not None)
    median_ms = percentile(delays_ms, 50) if delays_ms else None
    lines.append("")
    lines.append(
        f"{doc['num_switches_made']}/{doc['num_switches_requested']} switches; delay median "
        f"{_fmt(median_ms, 3)} ms, max {_fmt(delays_ms[-1] if delays_ms else None, 3)} ms, "
        f"max {doc['max_delay_steps'] if doc['max_delay_steps'] is not None else '-'} steps "
        f"(target < 1: {'met' if doc['delay_target_met'] else 'MISSED'}); requests failed "
        f"{req['num_failed']}, truncated {req['num_truncated']} of {req['num_requests']}; "
        f"{_fmt(doc['output_tokens_per_s'])} output tok/s overall"
    )
    return "\n".join(lines)


def run_precision_switch(args: argparse.Namespace) -> int:
    """`sits bench precision-switch`: run, print the report, write --output-json; exit code 1
    when a request failed or was truncated, or fewer switches were made than asked."""
    print(f"Command: {command_line()}", flush=True)
    doc = run_precision_switch_benchmark(args)
    print(format_precision_switch(doc, with_command=False))  # the command was printed first
    write_json(args.output_json, doc)
    req = doc["requests"]
    ok = req["num_failed"] == 0 and req["num_truncated"] == 0
    return 0 if ok and doc["num_switches_made"] == doc["num_switches_requested"] else 1
