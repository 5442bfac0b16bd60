"""Where a step's time goes: CUDA kernel times of one eager decode step and one prefill step
(torch.profiler), the CUDA-graph decode step time, and the host time around it.

Usage (GPU machine, repo root):
    PYTHONPATH=src python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
        --batch-sizes 1 10 64 --prefill-tokens 2048

Prints, per case, the top kernels by total CUDA time (name, calls, total us, % of the step)
and a summary line: graph replay us, eager us, sum of kernel us, host us per step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _llm(shape: str, max_num_seqs: int, enforce_eager: bool):
    from sits import LLM
    from sits.bench.shapes import write_shape_dir

    return LLM(
        model=write_shape_dir(shape),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_num_seqs=max_num_seqs,
        max_model_len=4096,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.85,
    )


def _decode_plan(batch_size: int, context: int, block_size: int, first_block: int):
    from sits.core.plan import ScheduledRequest, StepPlan

    blocks_per_seq = -(-(context + 1) // block_size)
    scheduled = []
    for i in range(batch_size):
        first = first_block + i * blocks_per_seq
        blocks = list(range(first, first + blocks_per_seq))
        scheduled.append(ScheduledRequest(f"r{i}", [7], context, blocks, sample=False))
    return StepPlan(scheduled)


def _prefill_plan(num_tokens: int, block_size: int, first_block: int):
    from sits.core.plan import ScheduledRequest, StepPlan

    blocks = list(range(first_block, first_block + -(-num_tokens // block_size)))
    return StepPlan([ScheduledRequest("p", [5] * num_tokens, 0, blocks, sample=False)])


def _forward_fn(runner, plan):
    def fn():
        hidden, _ = runner._forward(plan)
        return hidden

    return fn


def _time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def _kernel_table(fn, label: str, top: int) -> float:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    print(f"\n### {label}: kernels {total:.0f} us in all")
    print("| kernel | calls | total us | % |")
    print("|---|---|---|---|")
    for e in events[:top]:
        share = 100 * e.self_device_time_total / max(total, 1e-9)
        name = e.key[:70].replace("|", "/")
        print(f"| {name} | {e.count} | {e.self_device_time_total:.0f} | {share:.1f} |")
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-weights", default="qwen3-30b-a3b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 10, 64])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per decode sequence")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args(argv)
    print("Command:", " ".join(sys.argv))
    llm = _llm(args.random_weights, max(args.batch_sizes), enforce_eager=False)
    runner = llm.engine_core.runner
    bs = runner.block_size
    rows = []
    with torch.inference_mode():
        for batch in args.batch_sizes:
            plan = _decode_plan(batch, args.context, bs, first_block=1)
            graph_us = _time_us(_forward_fn(runner, plan))
            graphs, runner.graphs = runner.graphs, None
            eager_us = _time_us(_forward_fn(runner, plan))
            kernels_us = _kernel_table(_forward_fn(runner, plan), f"decode batch {batch}", args.top)
            runner.graphs = graphs
            rows.append((f"decode b={batch} ctx={args.context}", graph_us, eager_us, kernels_us))
        plan = _prefill_plan(args.prefill_tokens, bs, first_block=1)
        eager_us = _time_us(_forward_fn(runner, plan), iters=5)
        kernels_us = _kernel_table(
            _forward_fn(runner, plan), f"prefill {args.prefill_tokens}", args.top
        )
        rows.append((f"prefill {args.prefill_tokens}", float("nan"), eager_us, kernels_us))
    print("\n| case | graph us | eager us | kernels us |")
    print("|---|---|---|---|")
    for name, graph_us, eager_us, kernels_us in rows:
        print(f"| {name} | {graph_us:.0f} | {eager_us:.0f} | {kernels_us:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
