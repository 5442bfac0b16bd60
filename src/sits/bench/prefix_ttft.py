"""Prefix caching benchmark (issue 7): TTFT of requests that share a long system prompt, with
prefix caching on and off, in the same run, for two arrival patterns.

Each of `--num-requests` requests is the same `--prefix-len`-token system prompt followed by
`--suffix-len` tokens of its own, and asks for one token (its TTFT is its whole latency). Two
engines with the same settings and weights are built one after the other: prefix caching off
("cold": every request prefills prefix + suffix) and on ("cached"). Each engine runs each
selected arrival pattern (`--arrival`), on an emptied prefix cache:

- sequential: each request is sent when the previous one has finished, so its TTFT is the
  prefill work of one request alone, no queueing. With caching on the first request fills the
  cache and the others prefill only their suffix; at small suffixes the per-step host work
  (schedule, input preparation, sampling) then dominates, which bounds the ratio from below.
- burst: all requests are added to the engine at the same moment (the issue's scenario: 200
  requests sharing a 2,000-token prompt arrive together) and the engine is stepped until all
  have finished; a request's TTFT is the time from that moment to the end of the step that
  produced its token (`time.perf_counter()` after each `EngineCore.step`). Each step computes
  at most `max_num_batched_tokens` tokens, so a request waits for the prefills queued before
  it: this measures the queueing that the cache removes (cold, every request costs
  prefix + suffix tokens of the budget; cached, only its suffix). Blocks enter the cache after
  the step that computed them, so the k requests admitted in the first step miss (k =
  min(num_requests, ceil(budget / (prefix + suffix))), the last one possibly as a chunk, which
  goes on without a second lookup); every later one hits the prefix's full blocks:
  (num_requests - k) * block_size * floor(prefix / block_size) hit tokens, when the first
  request's first step covers the prefix.

Prints the command and, per pattern, mean/p50/p99 TTFT and the engine steps run with caching
off and on, the ratio on/off of the means, the issue's target (mean TTFT with prefix caching
<= 20 % of the cold-cache TTFT) and the caching-on engine's prefix-cache counters for that
pattern (hit tokens: prefill tokens the cache saved). `--result-json` writes the sequential
pattern's `rows`, `ratio` and `prefix_cache` at the top level (as before `--arrival` existed)
and each pattern's results under its name: {"arrival": [...], "sequential": {...}, "burst":
{...}}, each with rows (mean/p50/p99 ms, engine steps), ratio, target_met, prefix_cache.

Examples:
```
# CPU, a tiny random-weights shape (as the test does); a 256-token step budget makes the
# burst queue (with the engine's 2048 all 8 requests fit in the first step: no hits)
python bench/prefix_ttft.py --random-weights tiny-qwen3-moe --dtype float32 \
    --prefix-len 200 --suffix-len 10 --num-requests 8 --max-num-batched-tokens 256
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
from collections.abc import Callable
from typing import Any

TARGET_RATIO = 0.20
ARRIVALS = ("sequential", "burst")


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(3, vocab_size) for _ in range(args.prefix_len)]
    return [
        prefix + [rng.randrange(3, vocab_size) for _ in range(args.suffix_len)]
        for _ in range(args.num_requests)
    ]


def _sequential(llm: Any, prompts: list[list[int]], params: Any) -> list[float]:
    """TTFT of each request (seconds), each sent when the previous one has finished."""
    ttfts = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
    return ttfts


def _burst(llm: Any, prompts: list[list[int]], params: Any) -> list[float]:
    """TTFT of each request (seconds, in prompt order), all added to the engine at once.

    The engine is stepped directly (`EngineCore.step`); a request's TTFT ends at the
    `time.perf_counter()` taken right after the step whose output carries its first token.

    Raises:
        RuntimeError: the engine reported an error for a request.
    """
    from sits.engine.output_processor import make_engine_requests

    core = llm.engine_core
    arrival_s = time.monotonic()
    requests = [
        make_engine_requests(
            f"burst-{i}",
            prompt,
            params,
            eos_token_ids=llm.info.eos_token_ids,
            max_model_len=llm.max_model_len,
            enable_prefix_caching=llm.config.enable_prefix_caching,
            arrival_time=arrival_s,
        )[0]
        for i, prompt in enumerate(prompts)
    ]
    first_token_s: dict[str, float] = {}
    start = time.perf_counter()
    for request in requests:
        core.add_request(request)
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.new_token_ids and out.request_id not in first_token_s:
                first_token_s[out.request_id] = now - start
    return [first_token_s[r.request_id] for r in requests]


MEASURES: dict[str, Callable[[Any, list[list[int]], Any], list[float]]] = {
    "sequential": _sequential,
    "burst": _burst,
}


def _cache_stats(llm: Any) -> dict[str, int]:
    return dataclasses.asdict(llm.engine_core.scheduler.prefix_cache_stats)


def _run(
    args: argparse.Namespace, model_dir: str, caching: bool, arrivals: list[str]
) -> dict[str, dict[str, Any]]:
    """Per arrival pattern: TTFT of each request (seconds), the engine steps it took and the
    prefix-cache counters it added (`PrefixCacheStats` fields, tokens), with prefix caching
    on or off."""
    import torch

    from sits import LLM, SamplingParams

    extra = {}
    if args.max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    extra["mixed_step_cuda_graphs"] = args.mixed_step_cuda_graphs
    llm = LLM(
        model=model_dir,
        load_format=args.load_format,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=args.prefix_len + args.suffix_len + 16,
        enable_prefix_caching=caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **extra,
    )
    vocab_size = llm.engine_core.runner.model.config.vocab_size
    prompts = _prompts(args, vocab_size)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(
        [{"prompt_token_ids": prompts[0][: args.suffix_len + 1]}], params, use_tqdm=False
    )  # warm-up
    runs = {}
    for arrival in arrivals:
        # Every pattern starts from an empty cache (the warm-up's or the previous pattern's
        # blocks would be free hits); no request holds blocks between patterns.
        assert llm.engine_core.scheduler.reset_prefix_cache(), "a request still holds blocks"
        before, first_step = _cache_stats(llm), llm.engine_core.stats.num_steps
        ttfts = MEASURES[arrival](llm, prompts, params)
        after = _cache_stats(llm)
        runs[arrival] = {
            "ttft_s": ttfts,
            "num_steps": llm.engine_core.stats.num_steps - first_step,
            "prefix_cache": {name: after[name] - before[name] for name in after},
        }
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs


def _summary(ttfts: list[float]) -> dict[str, float]:
    ordered = sorted(ttfts)
    return {
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "p50_ms": 1e3 * ordered[len(ordered) // 2],
        "p99_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def _report(
    args: argparse.Namespace, arrival: str, cold: dict[str, Any], cached: dict[str, Any]
) -> dict[str, Any]:
    """Print one pattern's table, ratio, verdict and prefix-cache counters; return them."""
    rows = {
        name: {**_summary(run["ttft_s"]), "num_steps": run["num_steps"]}
        for name, run in (("cold", cold), ("cached", cached))
    }
    ratio = rows["cached"]["mean_ms"] / rows["cold"]["mean_ms"]
    how = {
        "sequential": "one at a time (each sent when the previous one has finished)",
        "burst": "all added at the same moment",
    }[arrival]
    print(
        f"\nArrival {arrival}: {args.num_requests} requests of {args.prefix_len} shared + "
        f"{args.suffix_len} own tokens, {how}, 1 output token each"
    )
    print("| arrival | prefix caching | mean TTFT ms | p50 ms | p99 ms | engine steps |")
    print("|---|---|---|---|---|---|")
    for name, label in (("cold", "off"), ("cached", "on")):
        r = rows[name]
        print(
            f"| {arrival} | {label} | {r['mean_ms']:.2f} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} | {r['num_steps']} |"
        )
    met = ratio <= TARGET_RATIO
    print(
        f"{arrival}: cached / cold mean TTFT: {100 * ratio:.1f} % "
        f"(target <= {100 * TARGET_RATIO:.0f} %: {'met' if met else 'missed'})"
    )
    stats = cached["prefix_cache"]
    hit_pct = 100 * stats["num_hit_tokens"] / max(stats["num_query_tokens"], 1)
    print(
        f"{arrival}: prefix cache (caching on): {stats['num_hit_tokens']} hit tokens of "
        f"{stats['num_query_tokens']} prompt tokens looked up ({hit_pct:.1f} %) over "
        f"{stats['num_requests']} requests: prefill tokens the cache saved"
    )
    return {
        "rows": rows,
        "ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "target_met": met,
        "prefix_cache": stats,
    }


def main(argv: list[str] | None = None) -> int:
    from sits.bench.shapes import shape_names

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument(
        "--random-weights", choices=shape_names(), help="a named real shape, random weights"
    )
    p.add_argument("--load-format", default=None, help="default: dummy with --random-weights")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument(
        "--mixed-step-cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay CUDA graphs for steps with prompt tokens too (sits serve's flag, on)",
    )
    p.add_argument("--prefix-len", type=int, default=2000, help="shared system prompt tokens")
    p.add_argument("--suffix-len", type=int, default=100, help="tokens of each request's own")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument(
        "--arrival",
        choices=(*ARRIVALS, "both"),
        default="both",
        help="sequential: one at a time; burst: all at once; both (default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    from sits.bench.report import command_line
    from sits.bench.shapes import write_shape_dir

    print("Command:", command_line())
    model_dir = args.model or write_shape_dir(args.random_weights)
    if args.load_format is None:
        args.load_format = "dummy" if args.random_weights else "auto"
    arrivals = list(ARRIVALS) if args.arrival == "both" else [args.arrival]
    cold = _run(args, model_dir, caching=False, arrivals=arrivals)
    cached = _run(args, model_dir, caching=True, arrivals=arrivals)
    doc: dict[str, Any] = {"arrival": arrivals}
    for arrival in arrivals:
        doc[arrival] = _report(args, arrival, cold[arrival], cached[arrival])
    if "sequential" in doc:  # the keys this script wrote before --arrival existed
        doc.update({k: doc["sequential"][k] for k in ("rows", "ratio", "prefix_cache")})
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
