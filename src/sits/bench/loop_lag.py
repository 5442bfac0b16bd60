"""Event-loop lag of the HTTP server with the engine in a thread or in its own process.

The server's asyncio loop (HTTP, admission, detokenizing, SSE writes) shares the GIL with the
engine's step loop when the engine runs in a thread of the same process; on a GPU that thread
runs Python kernel launches almost nonstop and every socket call of the loop waits for the
GIL. `sits serve --engine-process` moves the engine core to its own process. This benchmark
starts the same server both ways (the thread mode is the peer, measured in the same run),
sends the same `sits bench serve` workload to each, and prints per mode: output tok/s, client
TTFT and ITL percentiles, and the server's own `sits:event_loop_lag_seconds` over the run
(mean, and the share of samples over 100 ms).

Examples:
```
# CPU, the built-in demo model
python bench/loop_lag.py --num-prompts 64 --input-len 128 --output-len 32
# H200, the qwen3-30b-a3b shape with random weights
python bench/loop_lag.py --model /tmp/sits-qos-shape --serve-args "--load-format dummy \
    --tokenizer src/sits/demo_model --dtype bfloat16" --num-prompts 1000 --input-len 512 \
    --output-len 128 --request-rate 40
```
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

LAG = "sits:event_loop_lag_seconds"
MODES = {"thread": [], "process": ["--engine-process"]}


def lag_counts(metrics_text: str) -> dict[str, float]:
    """Sum, count and the count of samples <= 0.1 s of the lag histogram in a /metrics body."""
    out = {"sum": 0.0, "count": 0.0, "le_0.1": 0.0}
    for line in metrics_text.splitlines():
        if line.startswith(f"{LAG}_sum"):
            out["sum"] += float(line.split()[-1])
        elif line.startswith(f"{LAG}_count"):
            out["count"] += float(line.split()[-1])
        elif line.startswith(f"{LAG}_bucket") and 'le="0.1"' in line:
            out["le_0.1"] += float(line.split()[-1])
    return out


def lag_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean lag (ms) and share (%) of samples over 100 ms between two scrapes."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"mean_ms": 0.0, "over_100ms_pct": 0.0, "samples": 0.0}
    over = count - (after["le_0.1"] - before["le_0.1"])
    return {
        "mean_ms": 1e3 * (after["sum"] - before["sum"]) / count,
        "over_100ms_pct": 100 * over / count,
        "samples": count,
    }


def run_mode(args: argparse.Namespace, mode: str, workdir: Path) -> dict[str, Any]:
    """Start the server in `mode`, run the workload, return its figures."""
    from sits.bench.server_proc import SitsServer
    from sits.demo import ensure_demo_model

    model = args.model or ensure_demo_model()
    serve_args = [*shlex.split(args.serve_args), *MODES[mode]]
    result_path = workdir / f"{mode}.json"
    with SitsServer(model, serve_args, workdir / f"serve-{mode}.log") as server:
        before = lag_counts(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        bench = [
            sys.executable, "-m", "sits.bench.serve", "--base-url", server.base_url,
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--request-rate", str(args.request_rate),
            "--ignore-eos", "--no-gpu-info", "--result-json", str(result_path),
        ]  # fmt: skip
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        after = lag_counts(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    totals = json.loads(result_path.read_text())["totals"]
    return {
        "output_throughput": totals["output_throughput"],
        "ttft_ms": totals["ttft_ms"],
        "itl_ms": totals["itl_ms"],
        "completed": totals["completed"],
        "loop_lag": lag_summary(before, after),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in demo)")
    p.add_argument("--serve-args", default="", help="extra `sits serve` flags, one string")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", default="inf", help="requests/s (inf: all at once)")
    p.add_argument("--modes", default="thread,process", help="comma-separated, in order")
    p.add_argument("--result-json", default=None)
    args = p.parse_args(argv)
    from sits.bench.report import command_line

    print("Command:", command_line())
    rows = {}
    with tempfile.TemporaryDirectory(prefix="sits-loop-lag-") as tmp:
        for mode in args.modes.split(","):
            rows[mode] = run_mode(args, mode, Path(tmp))
    print(
        f"\n{args.num_prompts} requests x {args.input_len} in / {args.output_len} out, "
        f"rate {args.request_rate}"
    )
    print("| engine | done | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p99 ms "
          "| loop lag mean ms | lag samples > 100 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        lag = r["loop_lag"]
        print(
            f"| {mode} | {r['completed']} | {r['output_throughput']:.1f} | "
            f"{r['ttft_ms']['p50']:.1f} | {r['ttft_ms']['p99']:.1f} | {r['itl_ms']['p99']:.1f} | "
            f"{lag['mean_ms']:.2f} | {lag['over_100ms_pct']:.1f} % |"
        )
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
