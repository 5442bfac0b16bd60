"""QoS vs FCFS on the CPU with a modelled device: the scheduler's share of the issue-6 ratio.

The real engine (scheduler, TPOT pacing, reservations, start deadlines) runs the issue-6 mix
in real time, but the model runner is replaced by a sleep of a modelled device time per step:
`--step-base-ms` + `--per-row-us` x rows, with rows padded as the H200 runs them (mixed steps
to the mixed-step CUDA-graph token buckets, decode steps to the decode-graph batch sizes). The
default model is the H200's loop profile of qwen3-30b-a3b (runner 23.4 ms for a 256-decode
step, ~38 ms for ~1,150 rows; bench/RESULTS.md, 2026-11-30): with it, QoS steps ran at 44 ms
carrying ~1,180 rows, as on the H200.

Both modes see the same device cost per row, so the ratio printed is what the scheduling
alone allows; a lower ratio on the GPU is device time that QoS steps cost beyond it. Host time
(scheduling, updates) is this machine's. Arrivals are Poisson (seeded), 512-token prompts of
random ids, 128 output tokens; the burstable tenant's new work is shed once its oldest queued
request waited 4.5 s, and its queued requests expire 4.5 s after arrival (the server's rules,
`sits.server.qos`). Gold's TTFT is the engine's (arrival to first token).

With `--host-ms H` the run is on a virtual clock instead: each step costs its modelled device
time plus H ms of host time, nothing sleeps, and the same arguments give the same figures (a
run is over long before its duration), so policies can be compared closer than real time's
noise allows.

Usage (repo root): `PYTHONPATH=src python3 bench/qos_sim.py --duration-s 30`
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
import time


def parse_curve(text: str) -> list[tuple[int, float]]:
    """`ROWS:MS,ROWS:MS,...` -> [(rows, seconds)] sorted by rows (at least two points).

    Raises:
        ValueError: malformed, or fewer than two points.
    """
    points = sorted((int(r), float(ms) / 1e3) for r, ms in (p.split(":") for p in text.split(",")))
    if len(points) < 2:
        raise ValueError(f"a cost curve needs at least two ROWS:MS points, got {text!r}")
    return points


def padded_rows(token_counts: list[int], buckets: list[int], batch_sizes: list[int]) -> int:
    """Rows the H200's runner runs for a step of these per-request token counts: a decode-only
    step (every count 1) pads to the decode-graph batch sizes, any other step to the
    mixed-step token buckets (the largest of either when past it)."""
    num_tokens = sum(token_counts)
    sizes = batch_sizes if all(n == 1 for n in token_counts) else buckets
    return sizes[min(bisect.bisect_left(sizes, num_tokens), len(sizes) - 1)]


def curve_from_steps(
    path: str, buckets: list[int], batch_sizes: list[int], min_steps: int = 5
) -> list[tuple[int, float]]:
    """A cost curve from a recording of live steps (`SITS_STEP_SHAPES_FILE`: one JSON object
    per step with "runner_ms" and "reqs", [start, tokens] per request): the median runner
    seconds of the steps of each padded row count seen at least `min_steps` times.

    Raises:
        ValueError: fewer than two row counts have enough steps.
    """
    from sits.engine.step_shapes import read_step_shapes

    by_rows: dict[int, list[float]] = {}
    for step in read_step_shapes(path):
        rows = padded_rows([n for _, n in step["reqs"]], buckets, batch_sizes)
        by_rows.setdefault(rows, []).append(step["runner_ms"] / 1e3)
    points = sorted((r, statistics.median(v)) for r, v in by_rows.items() if len(v) >= min_steps)
    if len(points) < 2:
        raise ValueError(f"{path}: fewer than two row counts with {min_steps} steps or more")
    return points


def curve_s(points: list[tuple[int, float]], rows: int) -> float:
    """Seconds of a step of `rows` rows on the piecewise-linear curve (extended at both ends
    along its first and last segments)."""
    i = min(max(bisect.bisect_left(points, rows, key=lambda p: p[0]), 1), len(points) - 1)
    (r0, s0), (r1, s1) = points[i - 1], points[i]
    return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


class VirtualClock:
    """Seconds that pass only when the modelled runner says so (`--host-ms`)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def monotonic(self) -> float:
        return self.now_s


class _ModelledRunner:
    """The model runner with the device replaced by a sleep (module docstring): base +
    per-row seconds, or a measured cost curve when given; on a virtual clock, the step's time
    plus `host_s` is added to it instead."""

    def __init__(
        self, real, base_s: float, per_row_s: float, buckets, batch_sizes, curve=None,
        clock: VirtualClock | None = None, host_s: float = 0.0,
    ) -> None:  # fmt: skip
        self.real, self.base_s, self.per_row_s = real, base_s, per_row_s
        self.buckets, self.batch_sizes = list(buckets), list(batch_sizes)
        self.curve, self.clock, self.host_s = curve, clock, host_s
        self.rows = 0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def run(self, plan, while_gpu_runs=None):
        from sits.core.plan import StepResult

        if not plan.scheduled:  # nothing to run (the real runner returns at once)
            if self.clock is not None:
                self.clock.now_s += max(self.host_s, 1e-3)  # time passes all the same
            return StepResult()
        rows = padded_rows([sr.num_tokens for sr in plan.scheduled], self.buckets,
                           self.batch_sizes)  # fmt: skip
        self.rows += rows
        cost_s = self.base_s + self.per_row_s * rows
        if self.curve is not None:
            cost_s = curve_s(self.curve, rows)
        if self.clock is not None:
            self.clock.now_s += cost_s + self.host_s
        else:
            time.sleep(cost_s)
        if while_gpu_runs is not None:
            while_gpu_runs()
        result = StepResult()
        for sr in plan.scheduled:
            if sr.sample:
                result.sampled_token_ids[sr.request_id] = 7
        return result


def _run_mode(mode: str, args) -> dict:
    from sits.config import EngineConfig
    from sits.engine.builder import build_engine, tenant_policies_of
    from sits.runner.cuda_graphs import graph_batch_sizes, mixed_token_buckets
    from sits.tenancy.loader import load_tenants

    tenants = tenant_policies_of(load_tenants(args.tenants)) if mode == "qos" else ()
    config = EngineConfig(
        model=args.model, dtype="float32", max_num_seqs=256, max_num_batched_tokens=2048,
        max_model_len=1024, kv_cache_memory_bytes=2_000_000_000, skip_tokenizer_init=True,
        tpot_pacing_fraction=args.pacing_fraction,
        tpot_pacing_min_prefill_tokens=args.min_prefill_tokens,
    )  # fmt: skip
    core = build_engine(config, tenants).core
    buckets = mixed_token_buckets(config.max_num_batched_tokens)
    core.policy.pacer.token_buckets = tuple(buckets)  # as the H200's runner reports them
    curve = parse_curve(args.cost_curve) if args.cost_curve else None
    if args.cost_from_steps:
        curve = curve_from_steps(args.cost_from_steps, buckets, graph_batch_sizes(256))
        print(f"[{mode}] cost curve from {args.cost_from_steps}: --cost-curve "
              + ",".join(f"{r}:{s * 1e3:.2f}" for r, s in curve))  # fmt: skip
    clock = VirtualClock() if args.host_ms is not None else None
    host_s = (args.host_ms or 0.0) / 1e3
    runner = _ModelledRunner(core.runner, args.step_base_ms / 1e3, args.per_row_us / 1e6,
                             buckets, graph_batch_sizes(256), curve, clock, host_s)  # fmt: skip
    core.runner = core.stepper.runner = runner  # the step path runs it too
    if clock is not None:
        core.clock = clock.monotonic
    arrival, first, last, counts, num_tokens, elapsed_s = _drive(core, clock, mode, args)
    gold = [first[r] - arrival[r] for r in arrival if r.startswith("gold") and r in first]
    gold_tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in first
                 if r.startswith("gold") and counts[r] == args.output_len]  # fmt: skip
    steps = max(core.stats.num_steps, 1)
    return {
        "steps": core.stats.num_steps, "step_ms": elapsed_s / steps * 1e3,
        "tok_s": num_tokens / elapsed_s, "rows": runner.rows / steps,
        "schedule_ms": core.stats.phase_s["schedule"] / steps * 1e3,
        "update_ms": core.stats.phase_s["update"] / steps * 1e3,
        "gold_ttft_p50_ms": statistics.median(gold) * 1e3 if gold else None,
        "gold_ttft_met_pct": 100 * sum(t <= 1.0 for t in gold) / len(gold) if gold else None,
        "gold_tpot_p99_ms": sorted(gold_tpot)[int(0.99 * (len(gold_tpot) - 1))] * 1e3
        if gold_tpot else None,
    }  # fmt: skip


def _drive(core, clock: VirtualClock | None, mode: str, args) -> tuple:
    """Send the mix and step the engine for `args.duration_s`; returns (arrival, first token
    and last token times by request id, tokens by request id, output tokens, seconds)."""
    from sits.core.sampling_params import SamplingParams
    from sits.engine.output_processor import make_engine_requests

    monotonic = time.monotonic if clock is None else clock.monotonic
    rng = random.Random(args.seed)
    vocab = min(core.runner.model.config.vocab_size, 8192)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    rates = {"gold": args.gold_rate, "burst": args.burst_rate}
    t0 = monotonic()
    next_at = {name: t0 + rng.expovariate(rate) for name, rate in rates.items()}
    arrival, first, last, counts = {}, {}, {}, {}
    num_requests = num_tokens = 0
    while monotonic() - t0 < args.duration_s:
        if clock is not None and not core.has_unfinished_requests():
            clock.now_s = max(clock.now_s, min(next_at.values()))  # idle until the next arrival
        now = monotonic()
        for name, rate in rates.items():
            while next_at[name] <= now:
                at, next_at[name] = next_at[name], next_at[name] + rng.expovariate(rate)
                if mode == "qos" and name == "burst":
                    load = core.waiting_load().get("burst")
                    if (
                        load is not None
                        and load.oldest_arrival_s is not None
                        and now - load.oldest_arrival_s > 4.5
                    ):
                        continue  # the server sheds new over-quota work
                request_id = f"{name}-{num_requests}"
                num_requests += 1
                prompt = [rng.randrange(1, vocab) for _ in range(args.input_len)]
                deadline = at + 4.5 if mode == "qos" and name == "burst" else None
                for child in make_engine_requests(
                    request_id, prompt, params, eos_token_ids=(), max_model_len=1024,
                    enable_prefix_caching=True, arrival_time=at,
                    tenant_id=name if mode == "qos" else "default", start_deadline_s=deadline,
                ):  # fmt: skip
                    core.add_request(child)
                arrival[request_id] = at
        outputs = core.step()
        end_s = monotonic()
        for out in outputs:
            if out.new_token_ids:
                num_tokens += len(out.new_token_ids)
                first.setdefault(out.request_id, end_s)
                last[out.request_id] = end_s
                counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    return arrival, first, last, counts, num_tokens, monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Tenant-aware scheduling (QoS) against first-come-first-served (FCFS) on "
        "the CPU: the real engine with a modelled device time per step.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="src/sits/demo_model", help="checkpoint the engine loads")
    p.add_argument("--tenants", default="bench/qos/tenants.toml", help="tenants file (SLOs)")
    p.add_argument("--modes", default="qos,fcfs", help="comma-separated: qos, fcfs")
    p.add_argument("--duration-s", type=float, default=30.0, help="seconds of arrivals")
    p.add_argument("--pacing-fraction", type=float, default=0.9,
                   help="the engine's --tpot-pacing-fraction")  # fmt: skip
    p.add_argument("--min-prefill-tokens", type=int, default=0,
                   help="the engine's --tpot-pacing-min-prefill-tokens (0: off)")  # fmt: skip
    p.add_argument("--gold-rate", type=float, default=11.7,
                   help="guaranteed tenant's arrivals, req/s (30 %% of 39 req/s)")  # fmt: skip
    p.add_argument("--burst-rate", type=float, default=81.9,
                   help="burstable tenant's arrivals, req/s (3 x the capacity left)")  # fmt: skip
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--step-base-ms", type=float, default=19.2, help="device ms of any step")
    p.add_argument("--per-row-us", type=float, default=16.3, help="device us per padded row")
    p.add_argument(
        "--cost-curve",
        default=None,
        metavar="ROWS:MS,...",
        help="runner ms by padded rows, piecewise linear (instead of base + per row), e.g. "
        "256:23.4,768:32.45,1280:40.22,2048:47.5",
    )
    p.add_argument(
        "--cost-from-steps",
        default=None,
        metavar="FILE",
        help="the cost curve from a recording of live steps (SITS_STEP_SHAPES_FILE, e.g. "
        "gpu_check's steps-qos.jsonl): median runner ms per padded row count",
    )
    p.add_argument(
        "--host-ms",
        type=float,
        default=None,
        help="run on a virtual clock, each step costing its device time plus this many ms of "
        "host time (deterministic; the H200's QoS loop spent ~5 ms per step outside the runner)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts")
    args = p.parse_args(argv)
    if args.cost_curve and args.cost_from_steps:
        p.error("give --cost-curve or --cost-from-steps, not both")
    print("Command:", " ".join(sys.argv))
    results = {mode: _run_mode(mode, args) for mode in args.modes.split(",")}
    print("| mode | steps | ms/step | out tok/s | rows/step | schedule ms | update ms "
          "| gold TTFT p50 ms | gold TTFT met % | gold TPOT p99 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        p50 = "-" if r["gold_ttft_p50_ms"] is None else f"{r['gold_ttft_p50_ms']:.0f}"
        met = "-" if r["gold_ttft_met_pct"] is None else f"{r['gold_ttft_met_pct']:.1f}"
        tpot = "-" if r["gold_tpot_p99_ms"] is None else f"{r['gold_tpot_p99_ms']:.1f}"
        print(
            f"| {mode} | {r['steps']} | {r['step_ms']:.1f} | {r['tok_s']:.0f} | {r['rows']:.0f} "
            f"| {r['schedule_ms']:.2f} | {r['update_ms']:.2f} | {p50} | {met} | {tpot} |"
        )
    if {"qos", "fcfs"} <= results.keys():
        ratio = results["qos"]["tok_s"] / results["fcfs"]["tok_s"]
        print(f"output throughput QoS / FCFS (modelled device): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
