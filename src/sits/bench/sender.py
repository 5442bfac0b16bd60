"""Sending a benchmark's requests on schedule, in one client process or spread over several.

Every latency the benchmark reports is stamped on the client's own event loop, and one Python
process parses every streamed event of every request: at a few thousand events per second it
falls behind, and its lag lands in the TTFTs and ITLs it reports. So:
- `LoopLagProbe` measures that lag during the run (the report prints its p50 / p99 / max);
- `send_in_processes` deals the schedule round-robin to N spawned client processes, each with
  its own loop, HTTP client and probe. They share t = 0: every child signals it is ready, the
  parent then fixes t = 0 a moment ahead on the wall clock, and each child sends its requests
  at t = 0 + arrival. Each request's record is filled in the child that sent it and comes back
  with its index, so the merged records are those one process would have made.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any

import httpx

from sits.bench.client import make_client, send_streaming
from sits.bench.errors import BenchmarkError
from sits.bench.records import RequestRecord
from sits.obs.gc_pauses import freeze_startup_heap

_GO_AHEAD_S = 0.5  # t = 0 is this far ahead of the moment every child is ready
_READY_TIMEOUT_S = 120.0  # a child that does not start within this fails the run


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One request to send: its record's index, its arrival (seconds after t = 0), its JSON
    body and its headers."""

    index: int
    arrival_s: float
    body: dict[str, Any]
    headers: dict[str, str]


class LoopLagProbe:
    """The event loop's lag: a task that sleeps `period_s` at a time and records how late it
    wakes (ms, in `lags_ms`). `start()` on the running loop, `stop()` at the end.

    Args:
        period_s: the sleep between samples (seconds, > 0).

    Raises:
        ValueError: period_s <= 0.
    """

    def __init__(self, period_s: float = 0.01) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self.lags_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lags_ms.append(max(time.perf_counter() - before - self.period_s, 0.0) * 1e3)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def lag_summary(lags_ms: list[float]) -> dict[str, float] | None:
    """p50, p99 and max (ms) of samples in ms (loop lags, connect times), or None without any."""
    lags = sorted(lags_ms)
    if not lags:
        return None
    return {
        "p50": lags[min(len(lags) // 2, len(lags) - 1)],
        "p99": lags[min(int(0.99 * len(lags)), len(lags) - 1)],
        "max": lags[-1],
    }


async def send_on_schedule(
    client: httpx.AsyncClient,
    url: str,
    outgoing: list[Outgoing],
    records: dict[int, RequestRecord],
    start: float,
    max_concurrency: int | None = None,
) -> float:
    """Send each request at `start` + its arrival (`time.perf_counter()` clock) as its own task
    (at most `max_concurrency` in flight when set); returns the seconds from `start` until the
    last one ended. `records[index]` is filled by the request of that index."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(item: Outgoing) -> None:
        args = (client, url, item.body, item.headers, records[item.index], start)
        if slots is None:
            await send_streaming(*args)
            return
        async with slots:
            await send_streaming(*args)

    tasks = []
    for item in outgoing:
        delay = start + item.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(item)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start


async def send_with_probe(
    client: httpx.AsyncClient,
    url: str,
    outgoing: list[Outgoing],
    records: dict[int, RequestRecord],
    start: float,
    max_concurrency: int | None = None,
) -> tuple[float, list[float]]:
    """`send_on_schedule` with a `LoopLagProbe` running through it; returns (its seconds, the
    lag samples in ms)."""
    probe = LoopLagProbe()
    probe.start()
    try:
        duration_s = await send_on_schedule(client, url, outgoing, records, start, max_concurrency)
    finally:
        await probe.stop()
    return duration_s, probe.lags_ms


def _child(
    shard: int,
    url: str,
    outgoing: list[Outgoing],
    records: dict[int, RequestRecord],
    timeout_s: float,
    ready: Any,
    go: Any,
    start_unix_s: Any,
    results: Any,
) -> None:
    """A client process: send `outgoing` from the shared t = 0; put (shard, records,
    duration_s, lag samples) on `results`."""

    async def run() -> tuple[float, list[float]]:
        async with make_client(timeout_s) as client:
            freeze_startup_heap()
            ready.wait()
            go.wait()
            start = time.perf_counter() + (start_unix_s.value - time.time())
            try:
                return await send_with_probe(client, url, outgoing, records, start)
            finally:
                gc.unfreeze()

    duration_s, lags = asyncio.run(run())
    results.put((shard, records, duration_s, lags))


async def send_in_processes(
    url: str,
    outgoing: list[Outgoing],
    records: list[RequestRecord],
    num_procs: int,
    timeout_s: float,
) -> tuple[float, list[float]]:
    """Send `outgoing` from `num_procs` spawned client processes (module docstring); fills
    `records` (by index) and returns (seconds from t = 0 until the last request ended, every
    process's lag samples in ms).

    Raises:
        BenchmarkError: a client process did not start within `_READY_TIMEOUT_S` or died.
    """
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Barrier(num_procs + 1), ctx.Barrier(num_procs + 1)
    start_unix_s = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = []
    for shard in range(num_procs):
        mine = outgoing[shard::num_procs]
        args = (shard, url, mine, {o.index: records[o.index] for o in mine}, timeout_s,
                ready, go, start_unix_s, results)  # fmt: skip
        procs.append(ctx.Process(target=_child, args=args, name=f"sits-bench-client-{shard}"))
    for proc in procs:
        proc.start()
    try:
        await asyncio.to_thread(_release, ready, go, start_unix_s)
        collected = [await asyncio.to_thread(_take, results, procs) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
    lags: list[float] = []
    duration_s = 0.0
    for _, shard_records, shard_duration_s, shard_lags in collected:
        for index, record in shard_records.items():
            records[index] = record
        duration_s = max(duration_s, shard_duration_s)
        lags.extend(shard_lags)
    return duration_s, lags


def _release(ready: Any, go: Any, start_unix_s: Any) -> None:
    """Wait until every child is ready, fix t = 0 `_GO_AHEAD_S` ahead, let them go."""
    try:
        ready.wait(timeout=_READY_TIMEOUT_S)
    except Exception as exc:  # threading.BrokenBarrierError: a child never came
        raise BenchmarkError(f"a client process did not start in {_READY_TIMEOUT_S:.0f} s") from exc
    start_unix_s.value = time.time() + _GO_AHEAD_S
    go.wait()


def _take(results: Any, procs: list[Any]) -> tuple:
    """The next child's result; BenchmarkError when a child died without one."""
    while True:
        try:
            return results.get(timeout=1.0)
        except Exception:  # queue.Empty
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise BenchmarkError(
                    f"client process {dead[0].name} exited with {dead[0].exitcode}"
                ) from None
