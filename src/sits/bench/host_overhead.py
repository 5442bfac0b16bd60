"""Host (CPU) cost of an engine step outside the model forward, split by part, on a tiny model.

On a GPU the engine's batch-1 TPOT is longer than the decode forward (a CUDA-graph replay):
the rest is host work (scheduler, input prep, sampler, output processing, the LLM loop). That
work does not depend on the device, so it is measured here on the CPU with a tiny random model
(`tiny-qwen3-moe`, `load_format="dummy"`, `skip_tokenizer_init=True`) driving the real
`LLM.generate` loop.

Workload: B requests of 16 random prompt tokens and 64 output tokens each (ignore_eos), greedy
and temperature 1.0 / top_p 0.95 (as vLLM's throughput benchmark samples). Parts are timed with
time.perf_counter() wrappers around the engine's own methods; each column is the median over
the pure decode steps (every scheduled request computes one token) of one run, and of
`--repeats` runs the one with the least host time is kept (the machine may be shared). The
peer in the same run is the same loop with the model forward replaced by nothing (a fixed
hidden-state tensor is returned): its `host` column is the pure host cost.

Usage (repo root):
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/host_overhead.py --batch-sizes 1 16 64 256
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/host_overhead.py --profile 256 --sampling top_p

Columns (us per decode step): loop = one iteration of `LLM._run`'s while loop; step =
`EngineCore.step` (inside the loop); forward = the model's forward; logits =
`compute_logits`; host = loop - forward - logits; schedule = `Scheduler.schedule`; prep =
`InputBuffers.prepare`; sample = the `Sampler` call; run other = the rest of
`ModelRunner.run`; update = `Scheduler.update`; core other = the rest of `EngineCore.step`;
output = `OutputProcessor.process`; loop other = the rest of the loop. On the CPU the
top-p sampler's sort and exponential draws are real compute ([B, V] on one core); on a GPU
they are a few kernels, so read its `sample` column as an upper bound of the host part.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_PARTS = ("forward", "logits", "schedule", "prep", "sample", "run", "update", "output")
_COLUMNS = (
    "loop", "step", "forward", "logits", "host", "schedule", "prep", "sample", "run other",
    "update", "core other", "output", "loop other",
)  # fmt: skip
_LOOP_SPLIT = (  # the columns one step's loop time splits into
    "forward", "logits", "schedule", "prep", "sample", "run other", "update", "core other",
    "output", "loop other",
)  # fmt: skip
_MISSING = object()
_SAMPLING = {
    "greedy": {"temperature": 0.0},
    "top_p": {"temperature": 1.0, "top_p": 0.95},
}


@dataclass(slots=True)
class StepRecord:
    """Seconds spent in each timed part during one engine step (and the loop around it)."""

    start_s: float
    step_s: float = 0.0
    loop_s: float = 0.0
    decode: bool = False
    parts_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_PARTS, 0.0))


class StepTimer:
    """Wraps engine methods with perf_counter timers; one `StepRecord` per `EngineCore.step`."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []

    def add(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` timed into the current step's part `name`."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.records:
                    self.records[-1].parts_s[name] += time.perf_counter() - start

        return timed

    def step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`EngineCore.step` timed, opening a new record (its `while_gpu_runs` passed on)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            if self.records:
                self.records[-1].loop_s = start - self.records[-1].start_s
            record = StepRecord(start_s=start)
            self.records.append(record)
            out = fn(*args, **kwargs)
            record.step_s = time.perf_counter() - start
            return out

        return timed

    def schedule(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`Scheduler.schedule` timed; marks pure decode steps."""
        timed_fn = self.add("schedule", fn)

        def timed(*args: Any, **kwargs: Any) -> Any:
            plan = timed_fn(*args, **kwargs)
            if self.records:
                self.records[-1].decode = bool(plan.scheduled) and all(
                    sr.num_tokens == 1 for sr in plan.scheduled
                )
            return plan

        return timed

    def finish(self, end_s: float) -> None:
        if self.records:
            self.records[-1].loop_s = end_s - self.records[-1].start_s


def build_llm(max_num_seqs: int, seed: int) -> Any:
    """The tiny MoE engine on the CPU with dummy weights and no tokenizer."""
    from sits import LLM
    from sits.bench.shapes import write_shape_dir

    return LLM(
        model=write_shape_dir("tiny-qwen3-moe"),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_model_len=1024,
        seed=seed,
    )


@contextlib.contextmanager
def instrumented(llm: Any, timer: StepTimer, null_forward: bool) -> Iterator[None]:
    """Install the timers (and the null forward) on `llm`'s engine; undone on exit."""
    from sits.engine.output_processor import OutputProcessor

    core = llm.engine_core
    runner, sched = core.runner, core.scheduler
    model = runner.model
    forward = model.forward
    if null_forward:
        hidden_size = model.arch.hidden_size
        fixed = torch.randn(runner.buffers.max_num_tokens, hidden_size)  # [max_tokens, hidden]

        def forward(input_ids: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
            return fixed[: input_ids.shape[0]]

    targets = [
        (core, "step", timer.step(core.step)),
        (sched, "schedule", timer.schedule(sched.schedule)),
        (sched, "update", timer.add("update", sched.update)),
        (runner, "run", timer.add("run", runner.run)),
        (runner, "sampler", timer.add("sample", runner.sampler)),
        (runner.buffers, "prepare", timer.add("prep", runner.buffers.prepare)),
        (model, "forward", timer.add("forward", forward)),
        (model, "compute_logits", timer.add("logits", model.compute_logits)),
    ]
    # (object, attribute, its own value before, or _MISSING when it came from the class)
    saved = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in targets]
    process = OutputProcessor.process
    for obj, name, wrapper in targets:
        setattr(obj, name, wrapper)
    OutputProcessor.process = timer.add("output", process)  # type: ignore[method-assign]
    try:
        yield
    finally:
        OutputProcessor.process = process  # type: ignore[method-assign]
        for obj, name, value in saved:
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def workload(batch_size: int, vocab_size: int, seed: int) -> list[dict[str, list[int]]]:
    """`batch_size` prompts of 16 random token ids (1..vocab-1: no EOS in prompts)."""
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(1, vocab_size) for _ in range(16)]}
        for _ in range(batch_size)
    ]


def run_case(
    llm: Any, batch_size: int, sampling: str, null_forward: bool, output_len: int, seed: int
) -> dict[str, float]:
    """Run one workload; returns the median us per decode step of each column, the number of
    decode steps ("steps") and the largest gap, in us, between a step's loop time and the
    sum of its parts ("unaccounted": 0 up to float rounding, the columns' invariant)."""
    from sits import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **_SAMPLING[sampling])
    prompts = workload(batch_size, llm.engine_core.runner.model.arch.vocab_size, seed)
    timer = StepTimer()
    with instrumented(llm, timer, null_forward):
        llm.generate(prompts, params, use_tqdm=False)
        timer.finish(time.perf_counter())
    decode = [r for r in timer.records if r.decode and r.loop_s > 0]
    assert decode, "no pure decode step was timed"
    columns: dict[str, list[float]] = {c: [] for c in _COLUMNS}
    unaccounted_s = 0.0
    for r in decode:
        p = r.parts_s
        values = {
            "loop": r.loop_s,
            "step": r.step_s,
            "forward": p["forward"],
            "logits": p["logits"],
            "host": r.loop_s - p["forward"] - p["logits"],
            "schedule": p["schedule"],
            "prep": p["prep"],
            "sample": p["sample"],
            "run other": p["run"] - p["prep"] - p["forward"] - p["logits"] - p["sample"],
            "update": p["update"],
            "core other": r.step_s - p["schedule"] - p["run"] - p["update"],
            "output": p["output"],
            "loop other": r.loop_s - r.step_s - p["output"],
        }
        for name, value in values.items():
            columns[name].append(value * 1e6)
        parts_s = sum(values[name] for name in _LOOP_SPLIT)
        unaccounted_s = max(unaccounted_s, abs(values["loop"] - parts_s))
    row = {name: statistics.median(values) for name, values in columns.items()}
    row["steps"] = float(len(decode))
    row["unaccounted"] = unaccounted_s * 1e6
    return row


def profile(llm: Any, batch_size: int, sampling: str, output_len: int, top: int) -> None:
    """cProfile of the null-forward loop; prints the top functions by own time."""
    from sits import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, **_SAMPLING[sampling])
    prompts = workload(batch_size, llm.engine_core.runner.model.arch.vocab_size, 0)
    timer = StepTimer()
    with instrumented(llm, timer, null_forward=True):
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(prompts, params, use_tqdm=False)
        prof.disable()
    num_steps = len(timer.records)
    print(f"\n### cProfile: batch {batch_size}, {sampling}, null forward ({num_steps} steps)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    from sits.bench.report import command_line, machine_info

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--sampling", nargs="+", choices=list(_SAMPLING), default=list(_SAMPLING))
    p.add_argument("--forward", nargs="+", choices=["real", "null"], default=["real", "null"])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="runs per case; the least host kept")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=None, metavar="B", help="cProfile batch B")
    p.add_argument("--top", type=int, default=30, help="functions listed by --profile")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("Command:", command_line())
    machine = machine_info()
    print(
        f"Machine: {machine['cpu']} ({machine['num_cpus']} CPUs), torch {machine['torch']}, "
        f"{args.threads} torch thread(s)"
    )
    llm = build_llm(max(max(args.batch_sizes), args.profile or 1), args.seed)
    vocab_size = llm.engine_core.runner.model.arch.vocab_size
    llm.generate(workload(4, vocab_size, 1), _params_warmup(), use_tqdm=False)  # warm-up
    if args.profile is not None:
        for sampling in args.sampling:
            profile(llm, args.profile, sampling, args.output_len, args.top)
        return 0
    headers = ["batch", "sampling", "forward", "decode steps", *_COLUMNS]
    print("\nus per decode step (median over pure decode steps, best of the repeats)\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for batch in args.batch_sizes:
        for sampling in args.sampling:
            for mode in args.forward:
                rows = [
                    run_case(llm, batch, sampling, mode == "null", args.output_len, args.seed)
                    for _ in range(args.repeats)
                ]
                row = min(rows, key=lambda r: r["host"])  # the least disturbed repeat
                cells = [str(batch), sampling, mode, str(int(row["steps"]))]
                cells += [f"{row[c]:.0f}" for c in _COLUMNS]
                print("| " + " | ".join(cells) + " |", flush=True)
    return 0


def _params_warmup() -> Any:
    from sits import SamplingParams

    return SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, top_p=0.95)


if __name__ == "__main__":
    sys.exit(main())
