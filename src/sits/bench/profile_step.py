"""Where a step's time goes: the CUDA kernels of decode, prefill and mixed steps (torch.profiler).

Kernel times of one decode step as its CUDA graph replays and of one eager prefill step, the
graph and eager decode step times; with
`--mixed-tokens`, a sweep of mixed steps (a decode batch plus fresh prompt chunks) by step size,
timed as the server runs them (mixed-step CUDA graphs), with each kernel's time per size.

Usage (GPU machine, repo root):
    PYTHONPATH=src python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
        --batch-sizes 1 10 64 --prefill-tokens 2048

Prints, per case, the top kernels by total CUDA time (name, calls, total us, % of the step)
and a summary table: graph replay us, eager us and the sum of kernel us per case (for decode,
the kernels of the graph replay; decode tokens are random, so the batch routes as a real one).

    PYTHONPATH=src python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
        --mixed-tokens 768 1024 1152 1280 1536 2048 --mixed-decodes 240 --context 576

prints, per step size (decodes + prompt tokens in chunks of `--mixed-chunk`), the replayed
step's wall time and the captured bucket, then a matrix of the top kernels' us per size.

    SITS_STEP_SHAPES_FILE=qos.jsonl sits serve ...   # records every step's shape
    PYTHONPATH=src python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
        --replay qos.jsonl fcfs.jsonl --replay-steps 40

rebuilds steps with prompt chunks from each recorded file (`sits.engine.step_shapes`; evenly
picked from the middle 80 % of the run, random tokens, no sampling) and prints per file the
mean recorded runner ms, the replayed forward's ms and each top kernel's us per step: the same
steps on the device alone, without the host and the server around them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile


def _llm(
    shape: str,
    max_num_seqs: int,
    enforce_eager: bool,
    max_model_len: int | None = None,
    dtype: str = "bfloat16",
    max_num_batched_tokens: int = 2048,
    quantization: str | None = None,
):
    """An engine on random weights of `shape`; max_model_len None: 4,096 or the shape's own
    limit when that is shorter (the tiny CPU shapes); steps of up to max_num_batched_tokens;
    `quantization` ("fp8", "int4" or None) quantizes the random weights online."""
    import json
    from pathlib import Path

    from sits import LLM
    from sits.bench.shapes import write_shape_dir

    model_dir = write_shape_dir(shape)
    if max_model_len is None:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        max_model_len = min(4096, config.get("max_position_embeddings", 4096))
    return LLM(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.85,
        quantization=quantization,
    )


def _decode_plan(batch_size: int, context: int, block_size: int, first_block: int, vocab: int):
    """`batch_size` one-token sequences at `context` cached tokens, on their own blocks. Token
    ids are random (seeded): one repeated id would send every sequence to the same experts."""
    import random

    from sits.core.plan import ScheduledRequest, StepPlan

    rng = random.Random(0)
    blocks_per_seq = -(-(context + 1) // block_size)
    scheduled = []
    for i in range(batch_size):
        first = first_block + i * blocks_per_seq
        blocks = list(range(first, first + blocks_per_seq))
        token = [rng.randrange(vocab)]
        scheduled.append(ScheduledRequest(f"r{i}", token, context, blocks, sample=False))
    return StepPlan(scheduled)


def _prefill_plan(num_tokens: int, block_size: int, first_block: int):
    from sits.core.plan import ScheduledRequest, StepPlan

    blocks = list(range(first_block, first_block + -(-num_tokens // block_size)))
    return StepPlan([ScheduledRequest("p", [5] * num_tokens, 0, blocks, sample=False)])


def _mixed_plan(
    decodes: int, context: int, num_tokens: int, chunk: int, block_size: int, vocab: int
):
    """`decodes` sequences at `context` cached tokens plus fresh prompt chunks of at most `chunk`
    tokens, `num_tokens` tokens in all; every sequence on its own blocks from block 1 on. Token
    ids are random (seeded): one repeated id would send every token to the same experts."""
    import random

    from sits.core.plan import ScheduledRequest, StepPlan

    rng = random.Random(0)
    blocks_per_decode = -(-(context + 1) // block_size)
    scheduled, next_block = [], 1
    for i in range(decodes):
        blocks = list(range(next_block, next_block + blocks_per_decode))
        next_block += blocks_per_decode
        token = [rng.randrange(vocab)]
        scheduled.append(ScheduledRequest(f"d{i}", token, context, blocks, sample=False))
    left = num_tokens - decodes
    while left > 0:
        size = min(chunk, left)
        blocks = list(range(next_block, next_block + -(-size // block_size)))
        next_block += len(blocks)
        tokens = [rng.randrange(vocab) for _ in range(size)]
        scheduled.append(ScheduledRequest(f"p{left}", tokens, 0, blocks, sample=False))
        left -= size
    return StepPlan(scheduled)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kernel_times(fn) -> dict[str, float]:
    """us per CUDA kernel name over one call of `fn` (graph replays included); on a machine
    without a GPU, us per CPU op (so the script's paths run anywhere)."""
    fn()
    _sync()
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        _sync()
    if on_gpu:
        return {
            e.key: e.self_device_time_total
            for e in prof.key_averages()
            if e.device_type.name == "CUDA"
        }
    return {e.key: e.self_cpu_time_total for e in prof.key_averages()}


def _mixed_sweep(runner, args) -> None:
    bs = runner.block_size
    vocab = runner.model.config.vocab_size
    buckets = runner.mixed_graphs.padded_tokens if runner.mixed_graphs else (lambda n: None)
    times: dict[int, dict[str, float]] = {}
    print(
        f"\n### mixed steps: {args.mixed_decodes} decodes at context {args.context} + prompt "
        f"chunks of <= {args.mixed_chunk}"
    )
    print("| step tokens | bucket | step us | kernels us |")
    print("|---|---|---|---|")
    for num_tokens in args.mixed_tokens:
        plan = _mixed_plan(
            args.mixed_decodes, args.context, num_tokens, args.mixed_chunk, bs, vocab
        )
        fn = _forward_fn(runner, plan)
        step_us = _time_us(fn)
        times[num_tokens] = _kernel_times(fn)
        kernels_us = sum(times[num_tokens].values())
        print(f"| {num_tokens} | {buckets(num_tokens)} | {step_us:.0f} | {kernels_us:.0f} |")
    _kernel_matrix(times, args.top)


def _replay_plan(reqs: list, block_size: int, vocab: int, rng):
    """A plan of the recorded [start_position, num_tokens] pairs, each on its own blocks."""
    from sits.core.plan import ScheduledRequest, StepPlan

    scheduled, next_block = [], 1
    for i, (start, num_tokens) in enumerate(reqs):
        num_blocks = -(-(start + num_tokens) // block_size)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        tokens = [rng.randrange(vocab) for _ in range(num_tokens)]
        scheduled.append(ScheduledRequest(f"r{i}", tokens, start, blocks, sample=False))
    return StepPlan(scheduled)


def _replay(runner, args) -> None:
    import random

    from sits.engine.step_shapes import read_step_shapes

    vocab = runner.model.config.vocab_size
    rng = random.Random(0)
    rows, kernels = [], {}
    for index, path in enumerate(args.replay):
        mixed = [s for s in read_step_shapes(path) if any(n > 1 for _, n in s["reqs"])]
        middle = mixed[len(mixed) // 10 : len(mixed) - len(mixed) // 10] or mixed
        stride = max(1, len(middle) // args.replay_steps)
        picked = middle[::stride][: args.replay_steps]
        totals: dict[str, float] = {}
        step_us = tokens = decodes = chunks = recorded_ms = 0.0
        for step in picked:
            plan = _replay_plan(step["reqs"], runner.block_size, vocab, rng)
            fn = _forward_fn(runner, plan)
            step_us += _time_us(fn, iters=5)
            for name, us in _kernel_times(fn).items():
                totals[name] = totals.get(name, 0.0) + us
            tokens += sum(n for _, n in step["reqs"])
            decodes += sum(1 for _, n in step["reqs"] if n == 1)
            chunks += sum(1 for _, n in step["reqs"] if n > 1)
            recorded_ms += step["runner_ms"]
        k = max(len(picked), 1)
        rows.append((path, len(picked), tokens / k, decodes / k, chunks / k, recorded_ms / k,
                     step_us / k / 1e3))  # fmt: skip
        kernels[f"{index + 1}: {path}"] = {name: us / k for name, us in totals.items()}
    print("\n### replayed steps with prompt chunks (forward only, no sampling)")
    print("| file | steps | tokens | decodes | chunks | recorded runner ms | replayed ms |")
    print("|---|---|---|---|---|---|---|")
    for path, n, tok, dec, ch, rec_ms, rep_ms in rows:
        print(f"| {path} | {n} | {tok:.1f} | {dec:.1f} | {ch:.2f} | {rec_ms:.2f} | {rep_ms:.2f} |")
    _kernel_matrix(kernels, args.top)


def _kernel_matrix(per_column: dict, top: int) -> None:
    """Print the `top` kernels by total us as rows, one column per key of `per_column`."""
    totals: dict[str, float] = {}
    for per_kernel in per_column.values():
        for name, us in per_kernel.items():
            totals[name] = totals.get(name, 0.0) + us
    names = sorted(totals, key=totals.get, reverse=True)[:top]
    print("\n| kernel | " + " | ".join(str(c) for c in per_column) + " |")
    print("|---|" + "---|" * len(per_column))
    for name in names:
        cells = " | ".join(f"{col.get(name, 0.0):.0f}" for col in per_column.values())
        print(f"| {name[:60].replace('|', '/')} | {cells} |")


def _forward_fn(runner, plan):
    def fn():
        hidden, _ = runner._forward(plan)
        return hidden

    return fn


def _time_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync()
    return (time.perf_counter() - start) / iters * 1e6


def _kernel_table(fn, label: str, top: int) -> float:
    """Print the top kernels of one call of `fn` (CUDA kernels; CPU ops on a machine without
    a GPU, so the script runs anywhere); returns their total us."""
    fn()
    _sync()
    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        fn()
        _sync()
    kind = "CUDA" if on_gpu else "CPU"
    rows = [
        (e.key, e.count, e.self_device_time_total if on_gpu else e.self_cpu_time_total)
        for e in prof.key_averages()
        if e.device_type.name == kind
    ]  # (name, calls, self us)
    total = sum(us for _, _, us in rows)
    rows.sort(key=lambda row: row[2], reverse=True)
    print(f"\n### {label}: kernels {total:.0f} us in all")
    print("| kernel | calls | total us | % |")
    print("|---|---|---|---|")
    for name, calls, us in rows[:top]:
        share = 100 * us / max(total, 1e-9)
        print(f"| {name[:70].replace('|', '/')} | {calls} | {us:.0f} | {share:.1f} |")
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-weights", default="qwen3-30b-a3b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 10, 64])
    p.add_argument("--context", type=int, default=1024, help="cached tokens per decode sequence")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--top", type=int, default=14)
    p.add_argument(
        "--mixed-tokens",
        type=int,
        nargs="*",
        default=[],
        help="only the mixed-step sweep, at these step sizes (tokens)",
    )
    p.add_argument("--mixed-decodes", type=int, default=240)
    p.add_argument("--mixed-chunk", type=int, default=512)
    p.add_argument(
        "--replay",
        nargs="*",
        default=[],
        help="only replay the steps of these SITS_STEP_SHAPES_FILE recordings",
    )
    p.add_argument("--replay-steps", type=int, default=40, help="steps replayed per file")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="default: 4096 or the shape's limit"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, help="online weight quantization: fp8, int4")
    args = p.parse_args(argv)
    print("Command:", " ".join(sys.argv))
    if args.mixed_tokens or args.replay:
        budget = max([2048, *args.mixed_tokens])
        llm = _llm(
            args.random_weights,
            256,
            False,
            args.max_model_len,
            args.dtype,
            budget,
            args.quantization,
        )
        with torch.inference_mode():
            if args.mixed_tokens:
                _mixed_sweep(llm.engine_core.runner, args)
            if args.replay:
                _replay(llm.engine_core.runner, args)
        return 0
    llm = _llm(
        args.random_weights,
        max(args.batch_sizes),
        False,
        args.max_model_len,
        args.dtype,
        quantization=args.quantization,
    )
    runner = llm.engine_core.runner
    bs = runner.block_size
    rows = []
    with torch.inference_mode():
        vocab = runner.model.config.vocab_size
        for batch in args.batch_sizes:
            plan = _decode_plan(batch, args.context, bs, first_block=1, vocab=vocab)
            graph_us = _time_us(_forward_fn(runner, plan))
            label = f"decode batch {batch}, CUDA graph replay"
            kernels_us = _kernel_table(_forward_fn(runner, plan), label, args.top)
            graphs, runner.graphs = runner.graphs, None
            eager_us = _time_us(_forward_fn(runner, plan))
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
