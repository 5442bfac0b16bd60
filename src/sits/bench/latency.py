"""`sits bench latency`: TTFT and TPOT of one fixed batch, measured on the engine's steps.

Each iteration queues `--batch-size` requests of `--input-len` random token ids (fresh ids per
iteration, so the prefix cache never hits), each generating exactly `--output-len` tokens
(greedy, `ignore_eos`), and steps the `EngineCore` until all finish, timing every step with
`time.perf_counter` (a step returns its sampled token ids to the host, so its time includes the
device work). Per request:
- TTFT = end of the step that produced its first token - the iteration's start;
- TPOT = (end of the step of its last token - end of the step of its first) / (output_len - 1).
Steps until every request has its first token are "prefill steps"; the rest "decode steps".
The first `--num-iters-warmup` iterations are not counted; a bar on stderr counts the
iterations (between them: outside the timed steps). Reported: TTFT, TPOT and iteration
latency (mean, p50, p99, ms), the decode step time, decode output tok/s (batch / mean step),
the rooflines of the prefill and decode steps (`sits.bench.roofline`), and where a decode step
goes: the mean ms per decode step of the engine's phase counters (`StepStats.phase_s`:
schedule, runner, update; within runner `ModelRunner.phase_s`: launch = inputs and the
forward's launch on the host, shadow = host work while the device runs, sync = waiting for
the device, then sampling), and "other" = the step's time outside them.
JSON (`--output-json`, schema "sits.bench.latency/1"): the `base_doc` head plus "workload",
"ttft_ms", "tpot_ms", "latency_ms", "decode_step_ms", "prefill_step_ms" ({"mean", "p50",
"p99", "count"}), "decode_output_tokens_per_s", "num_output_tokens", "rooflines"
{"prefill", "decode"}, "decode_step_phases_ms" ({phase: mean ms per decode step}, null
without decode steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from sits.bench.metrics import percentile
from sits.bench.offline_common import (
    add_offline_args,
    base_doc,
    fraction_text,
    header_lines,
    markdown_table,
    offline_setup,
    random_prompts,
    roofline_lines,
    step_roofline,
    write_json,
)
from sits.bench.report import command_line
from sits.bench.roofline import StepShape
from sits.bench.steps import StepRecorder, phase_counters, phases_text
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import SamplingParams
from sits.engine.output_processor import make_engine_requests

SCHEMA = "sits.bench.latency/1"
DESCRIPTION = (
    "Fixed-batch latency: TTFT and TPOT (mean, p50, p99) of --batch-size requests of "
    "--input-len random token ids generating --output-len tokens, timed on the engine's "
    "steps, with the prefill and decode rooflines."
)


def add_latency_args(p: argparse.ArgumentParser) -> None:
    """Add the `sits bench latency` flags."""
    add_offline_args(p, input_len=32, output_len=128)
    p.add_argument("--batch-size", type=int, default=8, help="requests per iteration (8)")
    p.add_argument("--num-iters", type=int, default=10, help="timed iterations (10)")
    p.add_argument("--num-iters-warmup", type=int, default=3, help="untimed iterations (3)")


@dataclass(slots=True)
class IterationTiming:
    """One iteration's measurements (seconds).

    Attributes:
        ttft_s, tpot_s: per request (tpot only when output_len >= 2).
        latency_s: start -> the last request finished.
        num_output_tokens: tokens generated.
        prefill_steps, decode_steps: (step duration, its shape) per step of each phase.
        decode_phase_s: seconds of each engine phase (`phase_counters`) over the decode steps.
    """

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    num_output_tokens: int = 0
    prefill_steps: list[tuple[float, StepShape]] = field(default_factory=list)
    decode_steps: list[tuple[float, StepShape]] = field(default_factory=list)
    decode_phase_s: dict[str, float] = field(default_factory=dict)


def run_iteration(
    llm: Any,
    recorder: StepRecorder,
    prompts: list[list[int]],
    output_len: int,
    id_prefix: str,
) -> IterationTiming:
    """Queue one request per prompt and step the engine until all finish (see the module
    docstring); the recorder must be attached to `llm.engine_core`."""
    core = llm.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    timing = IterationTiming()
    first_s: dict[str, float] = {}
    last_s: dict[str, float] = {}
    counts: dict[str, int] = {}
    recorder.take()
    start_s = time.perf_counter()
    for i, prompt in enumerate(prompts):
        for request in make_engine_requests(
            f"{id_prefix}-{i}",
            prompt,
            params,
            eos_token_ids=llm.info.eos_token_ids,
            max_model_len=llm.info.max_model_len,
            enable_prefix_caching=llm.config.enable_prefix_caching,
        ):
            core.add_request(request)
    while core.has_unfinished_requests():
        phases_before = phase_counters(core)
        step_start_s = time.perf_counter()
        outputs = core.step()
        end_s = time.perf_counter()
        prefill_phase = len(first_s) < len(prompts)
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.new_token_ids:
                first_s.setdefault(out.request_id, end_s)
                last_s[out.request_id] = end_s
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
        shapes = recorder.take()
        if shapes:  # an empty step (nothing scheduled) is not a step of either phase
            steps = timing.prefill_steps if prefill_phase else timing.decode_steps
            steps.append((end_s - step_start_s, shapes[0]))
            if not prefill_phase:
                for name, total_s in phase_counters(core).items():
                    spent_s = total_s - phases_before.get(name, 0.0)
                    timing.decode_phase_s[name] = timing.decode_phase_s.get(name, 0.0) + spent_s
    timing.latency_s = time.perf_counter() - start_s
    timing.ttft_s = [first_s[r] - start_s for r in first_s]
    if output_len >= 2:
        timing.tpot_s = [(last_s[r] - first_s[r]) / (counts[r] - 1) for r in first_s]
    timing.num_output_tokens = sum(counts.values())
    return timing


def _stats_ms(values_s: list[float]) -> dict[str, Any]:
    if not values_s:
        return {"mean": None, "p50": None, "p99": None, "count": 0}
    ms = [v * 1e3 for v in values_s]
    return {
        "mean": sum(ms) / len(ms),
        "p50": percentile(ms, 50),
        "p99": percentile(ms, 99),
        "count": len(ms),
    }


def run_latency_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark of the parsed flags; returns the result document (module docstring).

    Raises:
        InvalidParameterError: bad flags.
    """
    from sits.engine.llm import LLM

    if args.batch_size < 1 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise InvalidParameterError(
            "batch_size", "--batch-size and --num-iters must be >= 1, --num-iters-warmup >= 0"
        )
    setup = offline_setup(args)
    llm = LLM(**dataclasses.asdict(setup.config))
    recorder = StepRecorder().attach(llm.engine_core)
    timings = []
    for i in tqdm(range(args.num_iters_warmup + args.num_iters), desc="Iterations"):
        prompts = random_prompts(args.batch_size, args.input_len, setup.vocab_size, args.seed + i)
        timing = run_iteration(llm, recorder, prompts, args.output_len, f"it{i}")
        if i >= args.num_iters_warmup:
            timings.append(timing)
    return latency_doc(args, setup, llm, timings)


def latency_doc(
    args: argparse.Namespace, setup: Any, llm: Any, timings: list[IterationTiming]
) -> dict[str, Any]:
    """The result document of the timed iterations."""
    prefill = list(itertools.chain.from_iterable(t.prefill_steps for t in timings))
    decode = list(itertools.chain.from_iterable(t.decode_steps for t in timings))
    decode_step = _stats_ms([s for s, _ in decode])
    doc = base_doc(SCHEMA, setup, llm)
    doc["workload"] = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "sampling": "greedy, ignore_eos",
        "seed": args.seed,
    }
    doc["ttft_ms"] = _stats_ms([v for t in timings for v in t.ttft_s])
    doc["tpot_ms"] = _stats_ms([v for t in timings for v in t.tpot_s])
    doc["latency_ms"] = _stats_ms([t.latency_s for t in timings])
    doc["prefill_step_ms"] = _stats_ms([s for s, _ in prefill])
    doc["decode_step_ms"] = decode_step
    doc["decode_output_tokens_per_s"] = (
        None if not decode else args.batch_size / (decode_step["mean"] / 1e3)
    )
    doc["num_output_tokens"] = [t.num_output_tokens for t in timings]
    doc["decode_step_phases_ms"] = _phases_ms(timings, len(decode), sum(s for s, _ in decode))
    doc["rooflines"] = {
        "prefill": step_roofline(
            llm, "prefill steps", [s for _, s in prefill], sum(s for s, _ in prefill)
        ),
        "decode": step_roofline(
            llm, "decode steps", [s for _, s in decode], sum(s for s, _ in decode)
        ),
    }
    return doc


def _phases_ms(
    timings: list[IterationTiming], num_steps: int, steps_s: float
) -> dict[str, float] | None:
    """Mean ms per decode step of each engine phase, plus "other" (the steps' time outside
    the core's schedule, runner and update phases); None without decode steps."""
    if not num_steps:
        return None
    totals: dict[str, float] = {}
    for timing in timings:
        for name, seconds in timing.decode_phase_s.items():
            totals[name] = totals.get(name, 0.0) + seconds
    core_s = sum(totals.get(name, 0.0) for name in ("schedule", "runner", "update"))
    totals["other"] = max(steps_s - core_s, 0.0)
    return {name: seconds / num_steps * 1e3 for name, seconds in totals.items()}


def _phase_line(phases: dict[str, float] | None) -> str | None:
    """`Decode step phases (ms per step): schedule 0.10, runner 11.60 (launch 0.30, ...)`."""
    if phases is None:
        return None
    return "Decode step phases (ms per step): " + phases_text(phases, "other", phases["other"])


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_latency(doc: dict[str, Any], with_command: bool = True) -> str:
    """The printed report: command (unless `with_command` is False: printed already), machine
    and model first, a markdown table last."""
    w = doc["workload"]
    lines = header_lines(doc, with_command)
    lines.append(
        f"Workload: batch {w['batch_size']} x {w['input_len']} in / {w['output_len']} out "
        f"({w['sampling']}), {w['num_iters']} iterations after {w['num_iters_warmup']} warm-up; "
        f"output tokens per iteration: {sorted(set(doc['num_output_tokens']))}"
    )
    for key in ("prefill", "decode"):
        lines += roofline_lines(doc["rooflines"][key])
    rows = []
    for label, key in (
        ("TTFT", "ttft_ms"),
        ("TPOT", "tpot_ms"),
        ("decode step", "decode_step_ms"),
        ("prefill step", "prefill_step_ms"),
        ("iteration", "latency_ms"),
    ):
        d = doc[key]
        rows.append([label, _fmt(d["mean"]), _fmt(d["p50"]), _fmt(d["p99"]), str(d["count"])])
    lines.append("")
    lines.append(
        f"batch {w['batch_size']}, {w['input_len']} in / {w['output_len']} out: decode "
        f"{_fmt(doc['decode_output_tokens_per_s'], 1)} output tok/s, decode roofline "
        f"{fraction_text(doc['rooflines']['decode'])}, prefill roofline "
        f"{fraction_text(doc['rooflines']['prefill'])}"
    )
    phase_line = _phase_line(doc.get("decode_step_phases_ms"))
    if phase_line is not None:
        lines.append(phase_line)
    lines.append("")
    lines += markdown_table(["(ms)", "mean", "p50", "p99", "count"], rows)
    return "\n".join(lines)


def run_latency(args: argparse.Namespace) -> int:
    """`sits bench latency`: run, print the report, write --output-json; exit code 0."""
    print(f"Command: {command_line()}", flush=True)
    doc = run_latency_benchmark(args)
    print(format_latency(doc, with_command=False))  # the command was printed first
    write_json(args.output_json, doc)
    return 0
