"""Is the device ever idle between steps? Device time per step vs wall time of an offline run.

Runs the `sits bench throughput` workload (random prompts, greedy, ignore_eos) on one engine
and brackets each step's device work with CUDA events: one recorded on the stream just before
the runner queues the step (`ModelRunner.launch`, or `run` for a synchronous step) and one just
after. The device reaches the first event when it has finished the previous step's work and
the host has queued this one, so the interval between the two events is the device's time on
the step, and the wall time less the sum of those intervals is time the device waited for the
host. Eager steps count the host's kernel launches inside their interval (an eager step whose
launches outpace nothing still counts as busy).

With `--sync-debug`, torch's CUDA sync debug mode is on for the timed run and each distinct
place that synchronised the host with the device is printed once with its stack (a hidden
sync in a launched-ahead step makes the device idle while the host works).

Usage (GPU machine, repo root; on a CPU, e.g. `--random-weights tiny-llama`, it only checks
the plumbing):
    PYTHONPATH=src python3 bench/device_busy.py --random-weights llama-3.1-8b \
        --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 \
        --async-scheduling --sync-debug

Prints the command, then: wall s, steps, device-busy s (sum of step intervals), idle s and %,
and the busy ms per step by kind (decode-only steps vs steps with prompt tokens).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings


def main(argv: list[str] | None = None) -> int:
    import torch

    from sits import LLM
    from sits.bench.offline_common import random_prompts
    from sits.bench.shapes import write_shape_dir
    from sits.core.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--random-weights", default="llama-3.1-8b")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--sync-debug", action="store_true", help="print each distinct host sync")
    args = p.parse_args(argv)
    print("Command:", " ".join(sys.argv))
    llm = LLM(
        model=write_shape_dir(args.random_weights),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        async_scheduling=args.async_scheduling,
    )
    runner = llm.engine_core.runner
    on_gpu = runner.device.type == "cuda"
    spans: list[tuple[object, object, bool]] = []  # (start event, end event, has prompt tokens)

    def bracket(method):
        def wrapped(plan, *rest):
            if not on_gpu or plan.is_empty:
                return method(plan, *rest)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = method(plan, *rest)
            end.record()
            prompt = any(len(sr.token_ids) > 1 for sr in plan.scheduled)
            spans.append((start, end, prompt))
            return result

        return wrapped

    runner.launch = bracket(runner.launch)  # this script's own engine only
    runner.run = bracket(runner.run)
    vocab = runner.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = random_prompts(4, args.input_len, vocab, seed=1)
    llm.generate([{"prompt_token_ids": w} for w in warm], params, use_tqdm=False)
    spans.clear()
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    seen: dict[str, int] = collections.Counter()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return original(message, category, filename, lineno, file, line)
            where = "".join(traceback.format_stack(limit=12)[:-1])
            if seen[where] == 0:
                print(f"--- host sync: {message}\n{where}", flush=True)
            seen[where] += 1

        warnings.showwarning = show
        if args.sync_debug and on_gpu:
            torch.cuda.set_sync_debug_mode("warn")
        start_s = time.perf_counter()
        llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        wall_s = time.perf_counter() - start_s
        if on_gpu:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    if not on_gpu:
        print(f"wall {wall_s:.2f} s; no device timing on the CPU (the steps run on the host)")
        return 0
    busy = collections.defaultdict(list)
    for start, end, prompt in spans:
        busy["with prompt tokens" if prompt else "decode only"].append(start.elapsed_time(end))
    total_ms = sum(sum(v) for v in busy.values())
    print(f"wall {wall_s:.2f} s, {len(spans)} steps timed on the device")
    print(f"device busy {total_ms / 1e3:.2f} s, idle {wall_s - total_ms / 1e3:.2f} s "
          f"({100 * (1 - total_ms / 1e3 / wall_s):.1f} % of the wall time)")  # fmt: skip
    print("| steps | count | busy ms per step | busy s |")
    print("|---|---|---|---|")
    for kind, values in sorted(busy.items()):
        mean_ms, total_s = sum(values) / len(values), sum(values) / 1e3
        print(f"| {kind} | {len(values)} | {mean_ms:.2f} | {total_s:.2f} |")
    if seen:
        print(f"host syncs: {sum(seen.values())} at {len(seen)} places (stacks above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
