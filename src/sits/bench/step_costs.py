"""What an engine step costs by its shape: wall time of `EngineCore.step()` and of the model
runner inside it, grouped by (decoding sequences, prefill tokens), over an offline FCFS run
that keeps `max_num_seqs` sequences busy (like a server under a flood).

This is the data TPOT pacing works with (`sits.sched.step_policy`): how much a step's prefill
chunk adds to a decode batch's step, and how much of a step is host work around the runner.

Usage (GPU machine, repo root):
    PYTHONPATH=src python3 bench/step_costs.py --random-weights qwen3-30b-a3b \
        --num-prompts 1024 --input-len 512 --output-len 128

Prints a table: decoding sequences (bucket), prefill tokens (bucket), steps, mean step ms,
mean runner ms, mean host ms (step - runner), rows run (CUDA-graph padding included) and
prompt chunks; then the totals. `--paced-step-tokens 0,1024,1280` repeats the run in the same
engine once per value (each pass with prompts of its own, and prefix caching off: a pass that
found the last pass's prompts cached ran decode steps alone), each capping every step at that
many tokens as pacing with a fixed slack does (0: FCFS), and ends with a summary per value:
output tok/s, and the mean runner ms and rows of steps with prompt tokens and a full decode
batch (`--full-batch`).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time


def _bucket(value: int, width: int) -> int:
    return (value // width) * width


def main(argv: list[str] | None = None) -> int:
    from sits import LLM
    from sits.bench.offline_common import random_prompts
    from sits.bench.shapes import write_shape_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-weights", default="qwen3-30b-a3b")
    p.add_argument("--model", default=None, help="a model dir instead of --random-weights")
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq-bucket", type=int, default=64)
    p.add_argument("--token-bucket", type=int, default=512)
    p.add_argument(
        "--paced-step-tokens",
        default="0",
        help="comma-separated runs, one engine: each caps every step at this many tokens "
        "(decodes first, then prompt chunks cut to fit), as TPOT pacing does with a fixed "
        "slack; 0: FCFS (the token budget only). E.g. 0,1024,1280,1536",
    )
    p.add_argument(
        "--full-batch",
        type=int,
        default=224,
        help="the summary averages steps with prompt tokens and at least this many decodes",
    )
    args = p.parse_args(argv)
    print("Command:", " ".join(sys.argv))
    model = args.model or write_shape_dir(args.random_weights)
    llm = LLM(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len,
        enable_prefix_caching=False,  # every pass computes every prompt
    )
    core = llm.engine_core
    runner = core.runner
    runner_s: list[float] = []
    run = runner.run

    def timed_run(plan, *args):
        t0 = time.perf_counter()
        result = run(plan, *args)
        runner_s.append(time.perf_counter() - t0)
        return result

    runner.run = timed_run  # this script's own engine: nothing else sees the wrapper
    vocab = runner.model.config.vocab_size
    fcfs_pacer = core.policy.pacer
    summary = []
    for index, step_tokens in enumerate(int(t) for t in args.paced_step_tokens.split(",")):
        core.policy.pacer = _FixedStepPacer(fcfs_pacer, step_tokens) if step_tokens else fcfs_pacer
        print(f"\n## paced step tokens: {step_tokens or 'off (FCFS)'}")
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=index)
        summary.append((step_tokens, *_run_pass(core, runner_s, args, prompts, f"p{index}-")))
    print(
        f"\n| paced step tokens | steps | output tok/s | steps at >= {args.full_batch} "
        "decodes | their runner ms | their rows run |"
    )
    print("|---|---|---|---|---|---|")
    for step_tokens, num_steps, tok_s, num_full, run_ms, rows in summary:
        print(
            f"| {step_tokens or 'FCFS'} | {num_steps} | {tok_s:.1f} | {num_full} | {run_ms:.2f} "
            f"| {rows:.1f} |"
        )
    return 0


def _run_pass(core, runner_s: list[float], args, prompts, id_prefix: str) -> tuple:
    """One offline run of every prompt; prints its table. Returns (steps, output tok/s,
    steps with at least `args.full_batch` decodes, their mean runner ms and rows run)."""
    from sits.core.sampling_params import SamplingParams
    from sits.engine.output_processor import make_engine_requests

    runner = core.runner
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i, ids in enumerate(prompts):
        for child in make_engine_requests(
            f"{id_prefix}{i}",
            ids,
            params,
            eos_token_ids=(),
            max_model_len=args.input_len + args.output_len,
            enable_prefix_caching=False,
        ):
            core.add_request(child)
    groups: dict[tuple[int, int], list[tuple[float, float]]] = collections.defaultdict(list)
    full: list[tuple[float, int]] = []
    start, first_step = time.perf_counter(), core.stats.num_steps
    num_output = 0
    sched = core.scheduler
    while core.has_unfinished_requests():
        decoding = sum(1 for r in sched.running_requests() if r.num_output_tokens > 0)
        prefill_before = core.stats.num_prefill_tokens
        rows_before, chunks_before = runner.num_rows_run, core.stats.num_prefill_chunks
        t0 = time.perf_counter()
        outputs = core.step()
        step_s = time.perf_counter() - t0
        num_output += sum(len(o.new_token_ids) for o in outputs)
        prefill = core.stats.num_prefill_tokens - prefill_before
        key = (_bucket(decoding, args.seq_bucket), _bucket(prefill, args.token_bucket))
        sample = (
            step_s,
            runner_s[-1] if runner_s else 0.0,
            runner.num_rows_run - rows_before,
            core.stats.num_prefill_chunks - chunks_before,
        )
        groups[key].append(sample)
        if decoding >= args.full_batch and prefill:
            full.append((sample[1], sample[2]))
    wall_s = time.perf_counter() - start
    print(
        "| decoding seqs | prefill tokens | steps | step ms | runner ms | host ms | rows run "
        "| chunks |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (seqs, tokens), rows in sorted(groups.items()):
        step_ms, run_ms = (1e3 * sum(r[i] for r in rows) / len(rows) for i in (0, 1))
        num_rows, num_chunks = (sum(r[i] for r in rows) / len(rows) for i in (2, 3))
        print(
            f"| {seqs}-{seqs + args.seq_bucket - 1} | {tokens}-{tokens + args.token_bucket - 1} "
            f"| {len(rows)} | {step_ms:.2f} | {run_ms:.2f} | {step_ms - run_ms:.2f} "
            f"| {num_rows:.1f} | {num_chunks:.2f} |"
        )
    num_steps = core.stats.num_steps - first_step
    print(
        f"{num_steps} steps, {num_output} output tokens in {wall_s:.2f} s: "
        f"{num_output / wall_s:.1f} output tok/s"
    )
    num_full = len(full)
    run_ms = 1e3 * sum(f[0] for f in full) / num_full if full else 0.0
    rows = sum(f[1] for f in full) / num_full if full else 0.0
    return num_steps, num_output / wall_s, num_full, run_ms, rows


class _FixedStepPacer:
    """Stands in for `TpotPacer`: every step may take `step_tokens` less its decodes in
    prompt tokens (a paced step at a fixed slack, without the step-time model)."""

    enabled = True

    def __init__(self, pacer, step_tokens: int) -> None:
        self.pacer = pacer
        self.step_tokens = step_tokens

    def max_prefill_tokens(self, now_s: float, running) -> int:
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in running)
        return max(self.step_tokens - decodes, 0)

    def padded_tokens(self, num_tokens: int) -> int:
        return self.pacer.padded_tokens(num_tokens)

    def observe_step(self, *args) -> None:
        pass

    def forget(self, request_ids) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
