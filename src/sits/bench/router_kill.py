"""The router's kill test: what a `kill -9` of one replica under a stream load costs (issue 24).

On a fresh loopback fleet (`sits.bench.fleet_procs.Fleet`) of `--kill-replicas` replicas (3)
behind `sits router` (fake replicas answer after `--kill-ttft-ms`, 1000, so that a request can
be caught before its first token):
1. `--kill-streams` S (60) streamed requests of `--kill-output-len` tokens go to the router at
   once; the test waits until every one has its first token (they are all mid-stream) and notes
   the replica serving each (the router's `x-sits-replica` response header).
2. The first half of `--kill-new-requests` M (60) new requests go to the router; the test waits
   until the router has dispatched them (its in-flight count, `GET /v1/router/replicas`, is
   S + M/2): they now wait on a replica for their first token.
3. The replica serving the most streams (ties: the first in the fleet's order) is killed with
   SIGKILL (its whole process group); which requests had a first token at that moment is noted.
4. At once the other half of the new requests goes to the router, while the other streams go
   on. The router learns of the death from its own attempts (a reset or refused connection
   before the first byte: retried on another replica), its breaker and its `/health` probe.
5. Every request ends (or times out: `--kill-timeout-s` between bytes bounds a hang).
Classes (`failure_kind` of each failed request): `error_event` (an SSE error event arrived),
`cut` (the stream ended without `[DONE]` and without an error event), `timeout` (no byte for the
timeout: a hang), `transport` (another connection error), `status` (an HTTP error status).
The targets: every request that had its first token from the killed replica at the kill ends
with an error event (none hangs, none is cut silently), and no request without a first token at
the kill (the pending and the later new requests, wherever they were) fails: 0 lost; nor does a
stream on another replica. The router's retries and its view of the killed replica (status,
breaker) are read from `/metrics` and `/v1/router/replicas` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sits.bench.client import (
    COMPLETIONS,
    STREAM_CUT_ERROR,
    make_client,
    send_streaming,
)
from sits.bench.errors import BenchmarkError
from sits.bench.fleet_procs import Fleet, ReplicaSpec, request_body, router_counters
from sits.bench.records import RequestRecord
from sits.core.fleet import REPLICA_HEADER

KILL_COUNTS = ("kill_replicas", "kill_streams", "kill_new_requests", "kill_output_len")
_INDEX_HEADER = "x-sits-bench-request"
_POLL_S = 0.01


@dataclass(frozen=True, slots=True)
class KillConfig:
    """The kill test's load.

    Attributes:
        replicas: replicas in the fleet (>= 2: one is killed).
        streams: streams running when the replica is killed.
        new_requests: requests sent right after the kill.
        output_len: `max_tokens` of every request (the streams must outlast steps 1-4).
        timeout_s: httpx timeout of each request (connect, and between bytes).
        ttft_ms: the fake replicas' TTFT in this test (the pending requests' window).
    """

    replicas: int = 3
    streams: int = 60
    new_requests: int = 60
    output_len: int = 200
    timeout_s: float = 30.0
    ttft_ms: float = 1000.0


def add_kill_args(p: argparse.ArgumentParser) -> None:
    """The kill test's flags."""
    d = KillConfig()
    p.add_argument(
        "--kill-test",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the kill test after the overhead phase (default on)",
    )
    p.add_argument("--kill-replicas", type=int, default=d.replicas)
    p.add_argument(
        "--kill-streams",
        type=int,
        default=d.streams,
        help="streams running at the kill (default %(default)d)",
    )
    p.add_argument(
        "--kill-new-requests",
        type=int,
        default=d.new_requests,
        help="requests sent right after the kill (default %(default)d)",
    )
    p.add_argument("--kill-output-len", type=int, default=d.output_len)
    p.add_argument("--kill-timeout-s", type=float, default=d.timeout_s)
    p.add_argument(
        "--kill-ttft-ms",
        type=float,
        default=d.ttft_ms,
        help="fake replicas' TTFT in the kill test (default %(default)g)",
    )


def kill_config(args: argparse.Namespace) -> KillConfig:
    """The `KillConfig` of the parsed flags."""
    return KillConfig(
        args.kill_replicas,
        args.kill_streams,
        args.kill_new_requests,
        args.kill_output_len,
        args.kill_timeout_s,
        args.kill_ttft_ms,
    )


def failure_kind(record: RequestRecord) -> str | None:
    """How a request failed (classes in the module docstring); None when it succeeded."""
    if record.ok:
        return None
    if record.status is not None and record.status != 200:
        return "status"
    error = record.error or ""
    if error == STREAM_CUT_ERROR:
        return "cut"
    exc_name = error.split(":", 1)[0]
    exc_type = getattr(httpx, exc_name, None)
    if isinstance(exc_type, type) and issubclass(exc_type, httpx.HTTPError):
        return "timeout" if issubclass(exc_type, httpx.TimeoutException) else "transport"
    if record.status is None or error.startswith("bad event data"):
        return "transport"
    return "error_event"


async def _wait_started(records: list[RequestRecord], tasks: list[asyncio.Task]) -> None:
    """Return once every record has its first token or its task ended."""
    while not all(r.ttft_s is not None or t.done() for r, t in zip(records, tasks, strict=True)):
        await asyncio.sleep(_POLL_S)


async def _router_inflight(client: httpx.AsyncClient, fleet: Fleet) -> dict[str, int]:
    """The router's in-flight requests per replica url."""
    auth = {"Authorization": f"Bearer {fleet.router_key}"}
    response = await client.get(fleet.router_url + "/v1/router/replicas", headers=auth)
    response.raise_for_status()
    return {r["url"]: int(r["inflight"]) for r in response.json()["data"]}


async def _wait_dispatched(client: httpx.AsyncClient, fleet: Fleet, total: int) -> dict[str, int]:
    """Poll the router until `total` requests are in flight; returns the counts per replica."""
    while True:
        inflight = await _router_inflight(client, fleet)
        if sum(inflight.values()) >= total:
            return inflight
        await asyncio.sleep(_POLL_S)


def _victim(fleet: Fleet, served: dict[int, str], streams: int) -> str:
    counts = Counter(served.get(i) for i in range(streams))
    return max(fleet.replica_urls, key=lambda url: (counts[url], -fleet.replica_urls.index(url)))


async def _load_and_kill(fleet: Fleet, model: str, cfg: KillConfig) -> dict[str, Any]:
    """Steps 1-5 of the module docstring; returns the records, who served what, the victim,
    which requests had a first token at the kill, and the router's in-flight counts then."""
    total = cfg.streams + cfg.new_requests
    pending_end = cfg.streams + cfg.new_requests // 2
    records = [RequestRecord(i, "kill", 0.0, 0, cfg.output_len) for i in range(total)]
    served: dict[int, str] = {}

    async def note_replica(response: httpx.Response) -> None:
        index = response.request.headers.get(_INDEX_HEADER)
        if index is not None and REPLICA_HEADER in response.headers:
            served[int(index)] = response.headers[REPLICA_HEADER].rstrip("/")

    url = fleet.router_url + COMPLETIONS
    async with make_client(cfg.timeout_s) as client:
        client.event_hooks = {"request": [], "response": [note_replica]}
        start = time.perf_counter()

        def send(i: int) -> asyncio.Task:
            body = request_body(model, i, cfg.output_len)
            headers = {_INDEX_HEADER: str(i)}
            return asyncio.create_task(
                send_streaming(client, url, body, headers, records[i], start)
            )

        tasks = [send(i) for i in range(cfg.streams)]
        await asyncio.wait_for(_wait_started(records[: cfg.streams], tasks), cfg.timeout_s)
        tasks += [send(i) for i in range(cfg.streams, pending_end)]
        inflight = await asyncio.wait_for(
            _wait_dispatched(client, fleet, pending_end), cfg.timeout_s
        )
        victim = _victim(fleet, served, cfg.streams)
        fleet.replicas[fleet.replica_urls.index(victim)].kill()
        kill_at_s = time.perf_counter() - start
        started = {r.index for r in records if r.ttft_s is not None}
        finished = {i for i, t in enumerate(tasks) if t.done()}
        tasks += [send(i) for i in range(pending_end, total)]
        await asyncio.gather(*tasks)
    return {
        "records": records,
        "served": served,
        "victim": victim,
        "kill_at_s": kill_at_s,
        "started": started,
        "finished": finished,
        "inflight": inflight,
        "pending": pending_end - cfg.streams,
    }


def _kinds(records: list[RequestRecord]) -> dict[str, int]:
    counts = Counter(failure_kind(r) or "ok" for r in records)
    return dict(sorted(counts.items()))


def classify(run: dict[str, Any]) -> dict[str, Any]:
    """The counts of the kill test from `_load_and_kill`'s result (see the module docstring)."""
    records, served, victim = run["records"], run["served"], run["victim"]
    on_victim = [r for r in records if r.index in run["started"] and served.get(r.index) == victim]
    elsewhere = [r for r in records if r.index in run["started"] and served.get(r.index) != victim]
    not_started = [r for r in records if r.index not in run["started"]]
    killed_kinds = _kinds(on_victim)
    lost = [r for r in not_started if not r.ok]
    ended_ok = killed_kinds.get("error_event", 0) + killed_kinds.get("ok", 0)
    return {
        "victim": victim,
        "kill_at_s": run["kill_at_s"],
        "started_on_killed": len(on_victim),
        "started_on_killed_by_outcome": killed_kinds,
        "finished_before_kill": len(run["finished"]),
        "started_elsewhere": len(elsewhere),
        "started_elsewhere_failed": sum(not r.ok for r in elsewhere),
        "pending_at_kill": run["pending"],
        "pending_on_killed": run["inflight"].get(victim, 0) - len(on_victim),
        "not_started": len(not_started),
        "not_started_served_by": dict(
            sorted(Counter(served.get(r.index) for r in not_started if r.ok).items())
        ),
        "lost_not_started": len(lost),
        "lost_errors": sorted({f"{failure_kind(r)}: {r.error}" for r in lost})[:5],
        "met": {
            "killed_streams_end_with_error_event": ended_ok == len(on_victim),
            "zero_lost_not_started": not lost,
            "zero_failed_elsewhere": all(r.ok for r in elsewhere),
        },
    }


async def run_kill_test(
    spec: ReplicaSpec, cfg: KillConfig, log_dir: Path, router_args: list[str] | None = None
) -> dict[str, Any]:
    """Run the kill test on a fresh fleet; returns its document (`config`, `counts`, `router`).

    Raises:
        BenchmarkError: the fleet would not start, or the streams did not start in time.
    """
    if cfg.replicas < 2:
        raise BenchmarkError("the kill test needs at least 2 replicas")
    spec = dataclasses.replace(
        spec, output_len=max(spec.output_len, cfg.output_len), ttft_ms=cfg.ttft_ms
    )
    fleet = Fleet(spec, cfg.replicas, log_dir, router_args or [])
    await asyncio.to_thread(fleet.start)
    try:
        model = await asyncio.to_thread(fleet.model)
        try:
            run = await _load_and_kill(fleet, model, cfg)
        except TimeoutError:
            raise BenchmarkError(
                f"the kill test's streams did not all start in {cfg.timeout_s:g} s"
            ) from None
        counts = classify(run)
        view = await asyncio.to_thread(fleet.router_replicas)
        metrics = router_counters(await asyncio.to_thread(fleet.metrics_text))
    finally:
        await asyncio.to_thread(fleet.close)
    victim_view = next((r for r in view if r["url"] == counts["victim"]), {})
    return {
        "config": dataclasses.asdict(cfg),
        "counts": counts,
        "router": {
            "retries": metrics["retries"],
            "victim_status": victim_view.get("status"),
            "victim_breaker": victim_view.get("breaker"),
        },
    }


def format_kill(doc: dict[str, Any]) -> list[str]:
    """The printed lines of the kill test's document."""
    cfg, c, router = doc["config"], doc["counts"], doc["router"]
    met = {True: "met", False: "NOT met"}
    lost = f"; {c['lost_errors']}" if c["lost_errors"] else ""
    return [
        f"Kill test: {cfg['replicas']} replicas (fake TTFT {cfg['ttft_ms']:g} ms), "
        f"{cfg['streams']} streams of {cfg['output_len']} tokens, {c['pending_at_kill']} new "
        f"requests waiting for their first token, `kill -9` of {c['victim']} at "
        f"{c['kill_at_s']:.2f} s, then {cfg['new_requests'] - c['pending_at_kill']} more",
        f"- streams started on the killed replica: {c['started_on_killed']}, by outcome "
        f"{c['started_on_killed_by_outcome']} (target: all end with an SSE error event: "
        f"{met[c['met']['killed_streams_end_with_error_event']]})",
        f"- streams started on the other replicas: {c['started_elsewhere']}, failed "
        f"{c['started_elsewhere_failed']}",
        f"- requests not started at the kill: {c['not_started']} ({c['pending_on_killed']} of "
        f"them were waiting on the killed replica), served by {c['not_started_served_by']}",
        f"- lost requests that had not started: {c['lost_not_started']} "
        f"(target 0: {met[c['met']['zero_lost_not_started']]}){lost}",
        f"- router: retries {router['retries']}, killed replica {router['victim_status']}, "
        f"breaker {router['victim_breaker']}",
    ]
