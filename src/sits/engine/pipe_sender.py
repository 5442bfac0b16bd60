"""The engine process's outbound pipe, written from a thread.

The step loop's messages (a step's outputs, stats, heartbeats, call results) are pickled and
written to the parent's pipe. Done inline, that is ~2 ms of every 45 ms step on the H200 (the
loop profile's "send"), serialized with the GPU work. A step spends most of its time waiting
for the device with the GIL released (the sampled tokens' copy to the host), so a thread that
pickles and writes there hides the cost. Under TPOT pacing a step's length is fixed by the SLO,
so every millisecond the loop does not spend on the host is a millisecond of batch.

Invariants: messages reach the pipe in `send` order; at most `max_pending` wait, so a parent
that stops reading blocks the loop as an inline write would; a failed write is raised by the
next `send`.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any

_STOP = object()


class PipeSender:
    """Sends messages over a `Connection`, in order, from one daemon thread.

    Args:
        conn: the pipe's sending end.
        max_pending: messages queued at most; `send` blocks beyond (>= 1).

    Raises:
        ValueError: max_pending < 1.
    """

    def __init__(self, conn: Connection, max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._conn = conn
        self._queue: queue.Queue[Any] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-pipe-sender", daemon=True)
        self._thread.start()

    def send(self, message: Any) -> None:
        """Queue a picklable message.

        Raises:
            BrokenPipeError: an earlier write failed (the parent is gone); nothing is queued.
            RuntimeError: the sender was closed.
        """
        if self._error is not None:
            raise BrokenPipeError(f"the engine's output pipe failed: {self._error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("the pipe sender is closed")
        self._queue.put(message)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Write what is queued, then stop the thread (waiting at most `timeout_s` seconds).

        Returns:
            True when everything queued was written (False: a write failed or timed out).
        """
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                return False
            self._thread.join(timeout_s)
        return self._error is None and not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            message = self._queue.get()
            if message is _STOP:
                return
            if self._error is not None:
                continue  # the pipe is broken: drop, so that `send` never blocks for good
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:  # closed or broken pipe
                self._error = exc
