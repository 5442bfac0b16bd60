"""How long a new request waits for a busy HTTP event loop to accept it.

A synthetic server stands in for sits' HTTP process under a streaming load: `--streams` tasks
each wait on an asyncio queue; every `--step-ms` one "engine step" hands an item to every queue
(through `sits.engine.async_llm.BatchedDelivery`, `--batches` items per loop iteration), and each
woken task spins for `--work-us` (formatting and writing its chunk). Meanwhile a client opens a
new connection per request at `--rate` a second (as the benchmark client does) and times each
plain GET until its response. The peer rows hand a whole step over at once (batch = streams).

uvloop accepts one connection per poll of the loop (libuv/libuv#3696); asyncio's loop accepts
up to 100. With iterations longer than the gap between connections, uvloop's accept queue
grows for as long as the load lasts. Runs in sits' virtualenv (it imports sits and httpx);
the uvloop rows need `pip install uvloop` and are marked "not installed" without it.

Usage: python3 bench/accept_delay.py [--work-us 95] [--loops uvloop asyncio]
           [--batches 400 64] [--result-json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sits.bench.server_proc import free_port
from sits.engine.async_llm import DELIVERY_BATCH, BatchedDelivery

ROOT = Path(__file__).resolve().parents[1]


def serve(port: int, loop: str, batch: int, streams: int, work_s: float, step_s: float) -> None:
    """Run the synthetic server (see the module docstring) until killed."""
    import uvicorn

    async def stream(queue: asyncio.Queue) -> None:
        while True:
            await queue.get()
            start = time.perf_counter()
            while time.perf_counter() - start < work_s:
                pass

    async def steps() -> None:
        queues = [asyncio.Queue() for _ in range(streams)]
        tasks = [asyncio.ensure_future(stream(q)) for q in queues]
        delivery = BatchedDelivery(batch=batch)
        while tasks:
            await asyncio.sleep(step_s)
            delivery.put([(q, None) for q in queues])

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                asyncio.ensure_future(steps())
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop=loop, http="h11")


async def send_requests(port: int, rate: float, count: int) -> list[float]:
    """`count` GETs at `rate` a second, each on a new connection; their latencies (s)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    latencies: list[float] = []
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as client:

        async def one() -> None:
            start = time.perf_counter()
            (await client.get(f"http://127.0.0.1:{port}/")).raise_for_status()
            latencies.append(time.perf_counter() - start)

        t0, tasks = time.perf_counter(), []
        for i in range(count):
            await asyncio.sleep(max(t0 + i / rate - time.perf_counter(), 0.0))
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return sorted(latencies)


def measure(args: argparse.Namespace, loop: str, batch: int) -> list[float]:
    """Start a server with `loop` and `batch`, send the requests, stop it; latencies (s)."""
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", str(port), "--loop-impl", loop,
           "--batch", str(batch), "--streams", str(args.streams),
           "--work-us", str(args.work_us), "--step-ms", str(args.step_ms)]  # fmt: skip
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": path})
    try:
        deadline = time.monotonic() + 30.0
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError as exc:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"no synthetic server: {shlex.join(cmd)}") from exc
                time.sleep(0.1)
        time.sleep(1.0)  # let the steps start
        return asyncio.run(send_requests(port, args.rate, args.requests))
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=100.0, help="new connections a second")
    parser.add_argument("--requests", type=int, default=500, help="requests sent per row")
    parser.add_argument("--streams", type=int, default=400, help="queues woken each step")
    parser.add_argument("--work-us", type=float, default=95.0, help="each woken task's work")
    parser.add_argument("--step-ms", type=float, default=40.0, help="time between steps")
    parser.add_argument(
        "--loops",
        nargs="+",
        default=["uvloop", "asyncio"],
        choices=["uvloop", "asyncio"],
        help="event loops to measure",
    )
    parser.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=None,
        help=f"items per loop iteration; None: --streams, then DELIVERY_BATCH = {DELIVERY_BATCH}",
    )
    parser.add_argument("--result-json", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loop-impl", default="asyncio", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.loop_impl, args.batch, args.streams, args.work_us * 1e-6,
              args.step_ms * 1e-3)  # fmt: skip
        return
    print("Command: python3 " + shlex.join(sys.argv))
    print(f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")  # fmt: skip
    busy = args.streams * args.work_us / 1e3
    print(f"{args.streams} streams x {args.work_us:g} us every {args.step_ms:g} ms "
          f"({busy:.0f} ms of work a step); {args.requests} new connections at "
          f"{args.rate:g}/s")  # fmt: skip
    print("| loop | handed over per iteration | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|---|")
    rows = []
    for loop in args.loops:
        if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            print("| uvloop | (not installed) | - | - | - |")
            continue
        for batch in args.batches or [args.streams, DELIVERY_BATCH]:
            lat = measure(args, loop, batch)
            p50, p99 = lat[len(lat) // 2], lat[min(int(0.99 * len(lat)), len(lat) - 1)]
            rows.append({"loop": loop, "batch": batch, "p50_ms": p50 * 1e3,
                         "p99_ms": p99 * 1e3, "max_ms": lat[-1] * 1e3})  # fmt: skip
            print(f"| {loop} | {batch} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f} | {lat[-1] * 1e3:.1f} |")
    if args.result_json is not None:
        config = {k: v for k, v in vars(args).items() if k not in ("serve", "loop_impl", "batch")}
        doc = {"command": shlex.join(sys.argv), "config": config, "rows": rows}
        args.result_json.write_text(json.dumps(doc, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
