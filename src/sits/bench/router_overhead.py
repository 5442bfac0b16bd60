"""The fleet router's cost against a direct connection, in one run on the same replicas (issue 24).

`python bench/router_overhead.py` (or `python -m sits.bench.router_overhead`) starts a loopback
`Fleet` (`sits.bench.fleet_procs`): N replicas (default 2; paced fakes by default, or real
`sits serve` on the demo model with `--replicas-kind sits`) and `sits router` in front of them.
Two arms then send the same requests to the same replicas:
- **direct**: the client splits the requests round-robin over the replicas itself;
- **router**: every request goes to the router.
Each arm is a closed loop of C clients (`--concurrency`, default 200): each sends a streamed
`/v1/completions` request (`max_tokens` = `--output-len`, `ignore_eos`), reads it to the end and
sends the next, until `--num-requests` were sent. The prompts are short and distinct (under the
router's 256-character prefix block, so it routes by least load, not affinity). One untimed pass
of C requests through each arm warms the connections first. `--rounds` R repeats both arms,
alternating their order (direct-router, router-direct, ...) so machine noise hits both alike.
Per request (`sits.bench.client.send_streaming`, one new TCP connection per request, as `sits
bench serve`): TTFT = send -> first token chunk. Per arm, over every round (records pooled,
durations summed): requests, errors, TTFT p50 / p99, output tokens/s and requests/s, and the
client's own event-loop lag (p99: when it nears the TTFT, the client measured itself).
Verdict: the router's added TTFT (router - direct, p50 and p99, ms) against <= 2 ms at p50, and
its throughput ratio (router / direct output tokens/s) against >= 0.95.
Then, unless `--no-kill-test`, the kill test (`sits.bench.router_kill`) on a fresh fleet.
Everything is bounded: each request by `--request-timeout-s` (between bytes), each arm by
`--max-arm-s`, the start by `--startup-timeout-s`; every process is stopped on the way out.
`--json PATH` writes the document below (schema `sits.bench.router_overhead/1`):
```
{"schema", "command", "date", "machine", "config": {...}, "model",
 "rounds": [{"round", "arm", "summary": Summary, "client_loop_lag_ms"}],
 "arms": {"direct" | "router": {"summary": Summary, "client_loop_lag_ms"}},
 "comparison": {"added_ttft_p50_ms", "added_ttft_p99_ms", "throughput_ratio",
                "request_throughput_ratio", "targets": {...}, "met": {...}},
 "router_metrics": {"decisions": {...}, "retries": {...}},
 "kill_test": sits.bench.router_kill document | null}
```
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from sits.bench.client import COMPLETIONS, make_client, send_streaming
from sits.bench.errors import BenchmarkError
from sits.bench.fleet_procs import REPLICA_KINDS, Fleet, ReplicaSpec, request_body, router_counters
from sits.bench.metrics import summarize
from sits.bench.records import RequestRecord
from sits.bench.report import command_line, fmt, machine_info
from sits.bench.router_kill import (
    KILL_COUNTS,
    add_kill_args,
    format_kill,
    kill_config,
    run_kill_test,
)
from sits.bench.sender import LoopLagProbe, lag_summary

SCHEMA = "sits.bench.router_overhead/1"
ARMS = ("direct", "router")
TARGET_ADDED_TTFT_P50_MS = 2.0
TARGET_THROUGHPUT_RATIO = 0.95


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """One arm's closed-loop load.

    Attributes:
        concurrency: clients in flight at once (>= 1).
        num_requests: requests per arm and round (>= 1).
        output_len: `max_tokens` of each request.
        request_timeout_s: httpx timeout of each request (connect, and between bytes).
        max_arm_s: wall-clock bound of one arm (seconds).
    """

    concurrency: int = 200
    num_requests: int = 1000
    output_len: int = 32
    request_timeout_s: float = 60.0
    max_arm_s: float = 600.0


@dataclass(slots=True)
class ArmRun:
    """What one arm's run gave: every request's record, its wall time, the client's lag."""

    records: list[RequestRecord]
    duration_s: float
    lags_ms: list[float]


async def closed_loop(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    model: str,
    load: LoadConfig,
    arm: str,
    headers: dict[str, str] | None = None,
) -> ArmRun:
    """`load.concurrency` clients send `load.num_requests` requests, each its next one as soon as
    its last one ended; request i goes to `urls[i % len(urls)]` + `/v1/completions`.

    Raises:
        BenchmarkError: the arm took longer than `load.max_arm_s`.
    """
    n = load.num_requests
    records = [RequestRecord(i, arm, 0.0, 0, load.output_len) for i in range(n)]
    indices = iter(range(n))  # shared by the clients: each index is taken once
    start = time.perf_counter()

    async def one_client() -> None:
        for i in indices:
            body = request_body(model, i, load.output_len)
            url = urls[i % len(urls)] + COMPLETIONS
            await send_streaming(client, url, body, headers or {}, records[i], start)

    probe = LoopLagProbe()
    probe.start()
    try:
        clients = (one_client() for _ in range(min(load.concurrency, n)))
        await asyncio.wait_for(asyncio.gather(*clients), load.max_arm_s)
    except TimeoutError:
        raise BenchmarkError(f"the {arm} arm took more than {load.max_arm_s:g} s") from None
    finally:
        await probe.stop()
    return ArmRun(records, time.perf_counter() - start, probe.lags_ms)


def arm_json(runs: Sequence[ArmRun]) -> dict[str, Any]:
    """The summary of runs of one arm: records pooled, durations summed."""
    records = [r for run in runs for r in run.records]
    duration_s = sum(run.duration_s for run in runs)
    lags = [lag for run in runs for lag in run.lags_ms]
    return {
        "summary": summarize(records, duration_s).to_json(),
        "client_loop_lag_ms": lag_summary(lags),
    }


def compare(direct: dict[str, Any], router: dict[str, Any]) -> dict[str, Any]:
    """The router's added TTFT (router - direct, ms) and its throughput ratios, with targets."""

    def diff(key: str) -> float | None:
        a, b = router["ttft_ms"][key], direct["ttft_ms"][key]
        return None if a is None or b is None else a - b

    def ratio(key: str) -> float | None:
        return router[key] / direct[key] if direct[key] else None

    added_p50 = diff("p50")
    tput = ratio("output_throughput")
    return {
        "added_ttft_p50_ms": added_p50,
        "added_ttft_p99_ms": diff("p99"),
        "throughput_ratio": tput,
        "request_throughput_ratio": ratio("request_throughput"),
        "targets": {
            "added_ttft_p50_ms": TARGET_ADDED_TTFT_P50_MS,
            "throughput_ratio": TARGET_THROUGHPUT_RATIO,
        },
        "met": {
            "added_ttft_p50": added_p50 is not None and added_p50 <= TARGET_ADDED_TTFT_P50_MS,
            "throughput": tput is not None and tput >= TARGET_THROUGHPUT_RATIO,
        },
    }


def arm_order(round_index: int) -> tuple[str, str]:
    """The arms' order in a round: direct first in even rounds, router first in odd ones."""
    return ARMS if round_index % 2 == 0 else ARMS[::-1]


async def measure(fleet: Fleet, model: str, load: LoadConfig, rounds: int) -> dict[str, Any]:
    """Warm both arms, then run `rounds` rounds of both; returns the document's measured parts
    (`rounds`, `arms`, `comparison`)."""
    targets = {"direct": fleet.replica_urls, "router": [fleet.router_url]}
    warm = LoadConfig(
        load.concurrency,
        min(load.concurrency, load.num_requests),
        load.output_len,
        load.request_timeout_s,
        load.max_arm_s,
    )
    runs: dict[str, list[ArmRun]] = {arm: [] for arm in ARMS}
    per_round = []
    async with make_client(load.request_timeout_s) as client:
        for arm in ARMS:
            warmup = await closed_loop(client, targets[arm], model, warm, arm)
            failed = [r for r in warmup.records if not r.ok]
            if failed:
                raise BenchmarkError(
                    f"{len(failed)} of the {arm} arm's warm-up requests failed: {failed[0].error}"
                )
        for round_index in range(rounds):
            for arm in arm_order(round_index):
                run = await closed_loop(client, targets[arm], model, load, arm)
                runs[arm].append(run)
                per_round.append({"round": round_index, "arm": arm, **arm_json([run])})
    arms = {arm: arm_json(runs[arm]) for arm in ARMS}
    comparison = compare(arms["direct"]["summary"], arms["router"]["summary"])
    return {"rounds": per_round, "arms": arms, "comparison": comparison}


def _row(name: str, doc: dict[str, Any]) -> str:
    s, lag = doc["summary"], doc["client_loop_lag_ms"]
    cells = [
        name,
        str(s["num_requests"]),
        str(s["failed"]),
        fmt(s["ttft_ms"]["p50"]),
        fmt(s["ttft_ms"]["p99"]),
        fmt(s["output_throughput"], 1),
        fmt(s["request_throughput"], 1),
        fmt(lag["p99"] if lag else None, 1),
    ]
    return "| " + " | ".join(cells) + " |"


_HEADER = (
    "| arm | requests | errors | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | req/s "
    "| client lag p99 (ms) |\n|---|---|---|---|---|---|---|---|"
)


def format_report(doc: dict[str, Any]) -> str:
    """The printed report of a run's document (header, tables, verdict, kill test)."""
    m, c = doc["machine"], doc["config"]
    pacing = ""
    if c["replicas_kind"] == "fake":
        pacing = f"; fake pacing: TTFT {c['ttft_ms']:g} ms, ITL {c['itl_ms']:g} ms"
    lines = [
        f"Command: {doc['command']}",
        f"Date: {doc['date']}",
        f"Machine: {m['cpu']} ({m['num_cpus']} CPUs), {m['platform']}, Python {m['python']}",
        f"Fleet: {c['replicas']} x {c['replicas_kind']} replicas (model {doc['model']}{pacing}) "
        "behind `sits router`",
        f"Load: {c['concurrency']} concurrent streams, {c['num_requests']} requests of "
        f"{c['output_len']} tokens per arm and round, {c['rounds']} rounds",
        "",
        _HEADER,
        *(_row(arm, doc["arms"][arm]) for arm in ARMS),
        "",
        "Per round:",
        _HEADER,
        *(_row(f"{r['arm']} (round {r['round'] + 1})", r) for r in doc["rounds"]),
        "",
    ]
    cmp_ = doc["comparison"]
    met = {True: "met", False: "NOT met"}
    lines += [
        f"Router added TTFT: p50 {fmt(cmp_['added_ttft_p50_ms'])} ms "
        f"(target <= {TARGET_ADDED_TTFT_P50_MS:g} ms: {met[cmp_['met']['added_ttft_p50']]}), "
        f"p99 {fmt(cmp_['added_ttft_p99_ms'])} ms",
        f"Throughput router / direct: {fmt(cmp_['throughput_ratio'], 3)} output tok/s "
        f"(target >= {TARGET_THROUGHPUT_RATIO:g}: {met[cmp_['met']['throughput']]}), "
        f"{fmt(cmp_['request_throughput_ratio'], 3)} req/s",
        f"Router decisions: {doc['router_metrics']['decisions']}, "
        f"retries: {doc['router_metrics']['retries']}",
    ]
    if doc.get("kill_test") is not None:
        lines += ["", *format_kill(doc["kill_test"])]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags."""
    load, spec = LoadConfig(), ReplicaSpec()
    p = argparse.ArgumentParser(
        prog="python bench/router_overhead.py",
        description="The fleet router's added TTFT and throughput against direct connections "
        "to the same replicas, then requests lost when a replica is killed under load.",
    )
    p.add_argument("--replicas", type=int, default=2, help="replicas (default %(default)d)")
    p.add_argument(
        "--replicas-kind",
        choices=REPLICA_KINDS,
        default="fake",
        help="paced fake replicas (default) or real `sits serve`",
    )
    p.add_argument(
        "--model",
        default=None,
        help="`sits serve` checkpoint for --replicas-kind sits (default: the demo)",
    )
    p.add_argument("--serve-args", default="", help="extra `sits serve` flags (one string)")
    p.add_argument("--router-args", default="", help="extra `sits router` flags (one string)")
    p.add_argument("--concurrency", type=int, default=load.concurrency)
    p.add_argument(
        "--num-requests",
        type=int,
        default=load.num_requests,
        help="requests per arm and round (default %(default)d)",
    )
    p.add_argument("--rounds", type=int, default=2, help="rounds of both arms (default 2)")
    p.add_argument("--output-len", type=int, default=load.output_len)
    p.add_argument("--ttft-ms", type=float, default=spec.ttft_ms, help="fake replicas' TTFT")
    p.add_argument("--itl-ms", type=float, default=spec.itl_ms, help="fake replicas' ITL")
    p.add_argument("--request-timeout-s", type=float, default=load.request_timeout_s)
    p.add_argument("--max-arm-s", type=float, default=load.max_arm_s)
    p.add_argument("--startup-timeout-s", type=float, default=120.0)
    p.add_argument("--log-dir", default=None, help="processes' logs (default: a temporary dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the JSON document")
    add_kill_args(p)
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (`parser.error`) on a count below 1."""
    for name in ("replicas", "concurrency", "num_requests", "rounds", "output_len", *KILL_COUNTS):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Run the overhead phase (and the kill test unless turned off); returns the document.

    Raises:
        BenchmarkError: a process that would not start, an arm out of time.
    """
    import shlex

    model = args.model
    if args.replicas_kind == "sits" and model is None:
        from sits.demo import ensure_demo_model

        model = ensure_demo_model()
    spec = ReplicaSpec(
        args.replicas_kind,
        args.ttft_ms,
        args.itl_ms,
        args.output_len,
        model or "",
        tuple(shlex.split(args.serve_args)),
    )
    load = LoadConfig(
        args.concurrency, args.num_requests, args.output_len, args.request_timeout_s, args.max_arm_s
    )
    router_args = shlex.split(args.router_args)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command_line(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(include_gpu=False),
        "config": {
            "replicas": args.replicas,
            "replicas_kind": args.replicas_kind,
            "ttft_ms": args.ttft_ms,
            "itl_ms": args.itl_ms,
            "rounds": args.rounds,
            "serve_args": args.serve_args,
            "router_args": args.router_args,
            **asdict(load),
        },
    }
    with Fleet(
        spec, args.replicas, log_dir / "overhead", router_args, args.startup_timeout_s
    ) as fleet:
        doc["model"] = fleet.model()
        doc.update(asyncio.run(measure(fleet, doc["model"], load, args.rounds)))
        doc["router_metrics"] = router_counters(fleet.metrics_text())
    doc["kill_test"] = None
    if args.kill_test:
        kill = kill_config(args)
        doc["kill_test"] = asyncio.run(run_kill_test(spec, kill, log_dir / "kill", router_args))
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the exit code (0 done, 1 failed to run, 2 bad flags)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    try:
        with tempfile.TemporaryDirectory(prefix="sits-router-bench-") as tmp:
            log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
            doc = run(args, log_dir)
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_report(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
