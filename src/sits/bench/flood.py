"""A guaranteed tenant's TTFT under a flood of refused requests (issue 30, item 6).

`python bench/flood.py [--model M] [--flood-rps 250] [--duration 20]` starts one `sits serve`
(the demo model by default) with two tenants: "gold" (guaranteed, TTFT SLO `--gold-slo-ms`)
and "free" (best-effort, `--free-rpm` requests per minute). Two phases on the same server,
the first being the peer of the second:
1. gold alone: `--gold-rps` streamed requests per second for `--duration` seconds;
2. the same gold load while "free" sends `--flood-rps` requests per second, almost all of
   which the server refuses with 429.
It prints both phases' gold TTFT (p50, p99, max, SLO attainment) and the flood's answers by
status, and writes them as JSON with `--output-json`. The trial that filed the issue saw gold's
TTFT p99 go from 0.23 s to 4.1 s (500 ms SLO) on a 2-core machine: each refused request was
first tokenized on the server's one tokenizer thread (`ServerQos.precheck` now refuses before).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from sits.bench.client import make_client, quiet_http_logs, send_streaming
from sits.bench.metrics import percentile
from sits.bench.records import RequestRecord
from sits.bench.server_proc import SitsServer
from sits.tenancy import hash_api_key

GOLD_KEY, FREE_KEY = "sk-flood-gold", "sk-flood-free"
PROMPT = "def fibonacci(n):"


def tenants_toml(gold_slo_ms: float, free_rpm: int) -> str:
    """The two tenants of the bench."""
    return (
        f'[[tenants]]\nid = "gold"\napi_key_sha256 = ["{hash_api_key(GOLD_KEY)}"]\n'
        f'tier = "guaranteed"\nreserved_kv_fraction = 0.5\nttft_ms = {gold_slo_ms:g}\n\n'
        f'[[tenants]]\nid = "free"\napi_key_sha256 = ["{hash_api_key(FREE_KEY)}"]\n'
        f'tier = "best_effort"\nrequests_per_minute = {free_rpm}\n'
    )


async def _send_at_rate(
    client: Any, url: str, key: str, rps: float, duration_s: float, max_tokens: int, start: float
) -> list[RequestRecord]:
    """Streamed completions of one tenant at `rps` for `duration_s`; their records."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    records: list[RequestRecord] = []
    tasks = []
    count = int(rps * duration_s)
    for index in range(count):
        delay = start + index / rps - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RequestRecord(
            index=index, tenant=key, arrival_s=index / rps, input_len=0, output_len=max_tokens
        )
        records.append(record)
        tasks.append(asyncio.create_task(send_streaming(client, url, body, headers, record, start)))
    await asyncio.gather(*tasks)
    return records


async def run_phase(
    base_url: str, gold_rps: float, flood_rps: float, duration_s: float, max_tokens: int
) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """(gold records, flood records) of one phase (flood_rps 0: gold alone)."""
    url = f"{base_url}/v1/completions"
    async with make_client(timeout_s=600.0) as client:
        start = time.perf_counter()
        gold = _send_at_rate(client, url, GOLD_KEY, gold_rps, duration_s, max_tokens, start)
        if flood_rps <= 0:
            return await gold, []
        flood = _send_at_rate(client, url, FREE_KEY, flood_rps, duration_s, 1, start)
        gold_records, flood_records = await asyncio.gather(gold, flood)
        return gold_records, flood_records


def gold_summary(records: list[RequestRecord], slo_ms: float) -> dict[str, Any]:
    """Gold's TTFT figures, seconds (failed requests count against the SLO)."""
    ttfts = [r.ttft_s for r in records if r.ok and r.ttft_s is not None]
    met = sum(1 for t in ttfts if t * 1000 <= slo_ms)
    return {
        "requests": len(records),
        "ok": len(ttfts),
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "ttft_max_s": max(ttfts) if ttfts else None,
        "slo_attainment": met / len(records) if records else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--gold-rps", type=float, default=2.0)
    parser.add_argument("--gold-max-tokens", type=int, default=8)
    parser.add_argument("--gold-slo-ms", type=float, default=500.0)
    parser.add_argument("--flood-rps", type=float, default=250.0)
    parser.add_argument("--free-rpm", type=int, default=60)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--serve-args", default="", help="extra `sits serve` flags")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    print("command: " + shlex.join([sys.executable, *sys.argv]))
    quiet_http_logs()
    workdir = Path(tempfile.mkdtemp(prefix="sits-flood-"))
    tenants = workdir / "tenants.toml"
    tenants.write_text(tenants_toml(args.gold_slo_ms, args.free_rpm))
    serve_args = ["--tenants", str(tenants), *shlex.split(args.serve_args)]
    server = SitsServer(args.model or "", serve_args, workdir / "serve.log")
    if not args.model:  # `sits serve` without a model serves the built-in demo model
        server.command.remove("--model")
        server.command.remove("")
    report: dict[str, Any] = {}
    server.start()
    try:
        for name, flood_rps in (("gold alone", 0.0), ("gold + flood", args.flood_rps)):
            gold, flood = asyncio.run(
                run_phase(
                    server.base_url, args.gold_rps, flood_rps, args.duration, args.gold_max_tokens
                )
            )
            report[name] = {
                "gold": gold_summary(gold, args.gold_slo_ms),
                "flood_status": dict(Counter(str(r.status) for r in flood)),
            }
    finally:
        server.stop()
    print(f"\n| phase | gold requests | gold TTFT p50 s | p99 s | max s | SLO {args.gold_slo_ms:g} "
          "ms attained | flood answers |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, phase in report.items():
        gold = phase["gold"]

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.3f}"

        print(
            f"| {name} | {gold['ok']}/{gold['requests']} | {fmt(gold['ttft_p50_s'])} "
            f"| {fmt(gold['ttft_p99_s'])} | {fmt(gold['ttft_max_s'])} "
            f"| {fmt(gold['slo_attainment'])} | {phase['flood_status'] or '-'} |"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
