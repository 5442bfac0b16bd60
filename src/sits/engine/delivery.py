"""Handing a step's outputs to the requests' asyncio queues a few at a time.

Each hand-off wakes the request's task, which then formats and writes its stream chunk in the
event loop's next iteration. A step's outputs handed over at once (~400 streams on a busy
server) make that next iteration 20-30 ms of Python work. The loop polls its sockets only
between iterations, and uvloop accepts one new connection per poll (libuv 1.45 and later,
libuv/libuv#3696). When iterations last longer than the gap between arriving connections
(~11 ms at 90 a second), the kernel's accept queue grows, and new requests wait there unseen
by the app and its metrics: in one 120-s run on the H200 every request sent in a 5-s window
waited ~1-1.5 s, even those refused at once (bench/RESULTS.md, 2026-11-30 eighth session). On
a CPU, a uvloop server whose iterations took 20 ms kept 100 new connections a second waiting
1.7 s at the median, with 157 in the accept queue at the peak; asyncio's loop, which accepts
up to 100 per poll, kept them 0.1 s (bench/accept_delay.py measures it).
`BatchedDelivery` hands over at most `batch` outputs per iteration, in arrival order, so the
loop returns to its sockets every `batch` outputs; the work is the same, spread over more
iterations.

Invariants: items reach each queue in the order `put` received them; `flush` empties the
backlog at once (before an error is put directly on a queue, so it arrives after the outputs
that preceded it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Any

# Outputs handed over per event-loop iteration. A stream chunk costs the HTTP side ~50-90 us,
# so an iteration stays within ~6 ms. On a CPU (bench/accept_delay.py: 400 streams x 95 us
# every 40 ms, 100 new connections a second, uvloop) new requests waited 16.0 ms at the median
# with 64 a batch, 9.7 ms with 32 and 1,965 ms with the whole step at once; the HTTP process's
# CPU per streamed token (bench/http_cpu.sh: the demo model, 200 streams) was 85 us with 64,
# 86-87 us with the whole step and 91-98 us with 32.
DELIVERY_BATCH = 64


class BatchedDelivery:
    """A FIFO of (queue, item) pairs drained `batch` per event-loop iteration.

    Args:
        batch: pairs handed over per iteration (>= 1).

    Raises:
        ValueError: batch < 1.
    """

    def __init__(self, batch: int = DELIVERY_BATCH) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.batch = batch
        self._pending: deque[tuple[asyncio.Queue, Any]] = deque()
        self._scheduled_on: asyncio.AbstractEventLoop | None = None  # loop of the next drain

    def __len__(self) -> int:
        """Pairs not handed over yet."""
        return len(self._pending)

    def put(self, items: Iterable[tuple[asyncio.Queue, Any]]) -> None:
        """Queue `items` behind the backlog and hand over the first batch now; the rest follow
        one batch per loop iteration. Outside a running loop everything goes at once. A drain
        left scheduled on another loop (one `asyncio.run` ended with a backlog) is taken over
        by this one."""
        self._pending.extend(items)
        if self._scheduled_on is None or self._scheduled_on is not _running_loop():
            self._drain()

    def flush(self) -> None:
        """Hand over the whole backlog now."""
        while self._pending:
            queue, item = self._pending.popleft()
            queue.put_nowait(item)

    def _drain(self) -> None:
        self._scheduled_on = None
        loop = _running_loop()
        if loop is None:
            self.flush()
            return
        pending = self._pending
        for _ in range(min(self.batch, len(pending))):
            queue, item = pending.popleft()
            queue.put_nowait(item)
        if pending:
            self._scheduled_on = loop
            loop.call_soon(self._drain)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
