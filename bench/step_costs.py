"""What an engine step costs by its shape: wall time of `EngineCore.step()` and of the model
runner inside it, grouped by (decoding sequences, prefill tokens), over an offline FCFS run
that keeps `max_num_seqs` sequences busy (like a server under a flood).

This is the data TPOT pacing works with (`sits.sched.pacing`): how much a step's prefill
chunk adds to a decode batch's step, and how much of a step is host work around the runner.

Usage (GPU machine, repo root):
    PYTHONPATH=src python3 bench/step_costs.py --random-weights qwen3-30b-a3b \
        --num-prompts 1024 --input-len 512 --output-len 128

Prints a table: decoding sequences (bucket), prefill tokens (bucket), steps, mean step ms,
mean runner ms, mean host ms (step - runner); then the totals.
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
    from sits.core.sampling_params import SamplingParams
    from sits.engine.requests import make_engine_requests

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
        type=int,
        default=0,
        help="cap every step at this many tokens (decodes first, then prompt chunks cut to "
        "fit), as TPOT pacing does with a fixed slack; 0: FCFS (the token budget only)",
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
    if args.paced_step_tokens:
        core.pacer = _FixedStepPacer(core.pacer, args.paced_step_tokens)
    vocab = runner.model.config.vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i, ids in enumerate(random_prompts(args.num_prompts, args.input_len, vocab, seed=0)):
        for child in make_engine_requests(
            f"r{i}",
            ids,
            params,
            eos_token_ids=(),
            max_model_len=args.input_len + args.output_len,
            enable_prefix_caching=False,
        ):
            core.add_request(child)
    groups: dict[tuple[int, int], list[tuple[float, float]]] = collections.defaultdict(list)
    start = time.perf_counter()
    num_output = 0
    sched = core.scheduler
    while core.has_unfinished_requests():
        decoding = sum(1 for r in sched.running_requests() if r.num_output_tokens > 0)
        prefill_before = core.num_prefill_tokens
        rows_before, chunks_before = runner.num_rows_run, core.num_prefill_chunks
        t0 = time.perf_counter()
        outputs = core.step()
        step_s = time.perf_counter() - t0
        num_output += sum(len(o.new_token_ids) for o in outputs)
        prefill = core.num_prefill_tokens - prefill_before
        key = (_bucket(decoding, args.seq_bucket), _bucket(prefill, args.token_bucket))
        groups[key].append(
            (
                step_s,
                runner_s[-1] if runner_s else 0.0,
                runner.num_rows_run - rows_before,
                core.num_prefill_chunks - chunks_before,
            )
        )
    wall_s = time.perf_counter() - start
    print(
        "\n| decoding seqs | prefill tokens | steps | step ms | runner ms | host ms | rows run "
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
    print(
        f"\n{core.num_steps} steps, {num_output} output tokens in {wall_s:.2f} s: "
        f"{num_output / wall_s:.1f} output tok/s"
    )
    return 0


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
