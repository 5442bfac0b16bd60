"""Prefix caching benchmark (issue 7): TTFT of requests that share a long system prompt, with
prefix caching on and off, in the same run.

Each of `--num-requests` requests is the same `--prefix-len`-token system prompt followed by
`--suffix-len` tokens of its own, and asks for one token (its TTFT is its whole latency). The
requests arrive one after another (each is sent when the previous one has finished), so TTFT
measures the prefill the engine does, not queueing. Run A: prefix caching off (every request
prefills prefix + suffix). Run B: prefix caching on (the first request fills the cache; the
others prefill only their suffix). Both runs use the same engine settings and weights.

Prints the command, mean/p50/p99 TTFT of each run, the ratio B/A, and the issue's target
(mean TTFT with prefix caching <= 20 % of the cold-cache TTFT).

Examples:
```
# CPU, a tiny random-weights shape (as the test does)
python bench/prefix_ttft.py --random-weights tiny-qwen3-moe --dtype float32 \
    --prefix-len 200 --suffix-len 10 --num-requests 8
# H200, the issue's workload
python bench/prefix_ttft.py --random-weights qwen3-30b-a3b --prefix-len 2000 \
    --suffix-len 100 --num-requests 200 --result-json prefix.json
```
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from typing import Any

TARGET_RATIO = 0.20


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(args.prefix_len)]
    return [
        prefix + [rng.randrange(3, vocab_size) for _ in range(args.suffix_len)]
        for _ in range(args.num_requests)
    ]


def _run(args: argparse.Namespace, model_dir: str, caching: bool) -> dict[str, Any]:
    """TTFT of each request (seconds), sent one at a time, with prefix caching on or off."""
    import torch

    from sits import LLM, SamplingParams

    llm = LLM(
        model=model_dir,
        load_format=args.load_format,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.prefix_len + args.suffix_len + 16,
        enable_prefix_caching=caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    vocab_size = llm.engine_core.runner.model.config.vocab_size
    prompts = _prompts(args, vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][: args.suffix_len + 1]}], params)  # warm-up
    ttfts = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        ttfts.append(time.perf_counter() - start)
    stats = dataclasses.asdict(llm.engine_core.scheduler.prefix_cache_stats)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"ttft_s": ttfts, "prefix_cache": stats}


def _summary(ttfts: list[float]) -> dict[str, float]:
    ordered = sorted(ttfts)
    return {
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--random-weights", help="a named shape of sits.bench.shapes")
    p.add_argument("--load-format", default=None, help="default: dummy with --random-weights")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--prefix-len", type=int, default=2000, help="shared system prompt tokens")
    p.add_argument("--suffix-len", type=int, default=100, help="tokens of each request's own")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    from sits.bench.report import command_line
    from sits.bench.shapes import write_shape_dir

    print("Command:", command_line())
    model_dir = args.model or write_shape_dir(args.random_weights)
    if args.load_format is None:
        args.load_format = "dummy" if args.random_weights else "auto"
    runs = {"cold": _run(args, model_dir, caching=False), "cached": _run(args, model_dir, True)}
    rows = {name: _summary(run["ttft_s"]) for name, run in runs.items()}
    ratio = rows["cached"]["mean_ms"] / rows["cold"]["mean_ms"]
    print(
        f"\n{args.num_requests} requests of {args.prefix_len} shared + {args.suffix_len} own "
        "tokens, one at a time, 1 output token each"
    )
    print("| prefix caching | mean TTFT ms | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for name, label in (("cold", "off"), ("cached", "on")):
        r = rows[name]
        print(f"| {label} | {r['mean_ms']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    verdict = "met" if ratio <= TARGET_RATIO else "missed"
    print(f"\ncached / cold mean TTFT: {100 * ratio:.1f} % (target <= 20 %: {verdict})")
    if args.result_json:
        doc = {"rows": rows, "ratio": ratio, "prefix_cache": runs["cached"]["prefix_cache"]}
        with open(args.result_json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
