"""Sample the kernel's accept queues of listening TCP sockets while a benchmark runs.

A connection the kernel has completed but the server has not yet accepted waits in its
listening socket's accept queue: the client's connect() has returned, yet the server's app has
not seen the request. Such a wait shows in the client's TTFT and in no server metric. Linux
shows each queue's current length as the `rx_queue` of a LISTEN (state 0A) row of
/proc/net/tcp and /proc/net/tcp6.

Usage (until SIGTERM or SIGINT; then one summary line on stdout):
    python3 bench/qos/listen_queue.py --out listen-queue.txt [--interval-s 0.1] [--port P]
Each sample with a non-empty queue is a line "UNIX_TIME PORT QUEUED" in --out.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

LISTEN = "0A"
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def listen_queues(text: str) -> list[tuple[int, int]]:
    """(port, queued connections) of each LISTEN row of a /proc/net/tcp table.

    Raises:
        ValueError: a row's fields are not in /proc/net/tcp's format.
    """
    rows = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 5 or fields[3] != LISTEN:
            continue
        port = int(fields[1].rsplit(":", 1)[1], 16)
        rows.append((port, int(fields[4].split(":")[1], 16)))
    return rows


def sample(port: int | None) -> list[tuple[int, int]]:
    """The non-empty accept queues now (all ports, or `port` alone)."""
    found = []
    for table in TABLES:
        if table.exists():
            found += listen_queues(table.read_text())
    return [row for row in found if row[1] > 0 and (port is None or row[0] == port)]


def main(argv: list[str] | None = None) -> int:
    """Sample until SIGTERM or SIGINT, then print the summary line; returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the samples go")
    parser.add_argument("--interval-s", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("--port", type=int, default=None, help="only this listening port")
    args = parser.parse_args(argv)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    samples = nonempty = peak = 0
    peak_at = ""
    with args.out.open("w") as out:
        while not stop:
            now = time.time()
            rows = sample(args.port)
            samples += 1
            nonempty += bool(rows)
            for port, queued in rows:
                out.write(f"{now:.3f} {port} {queued}\n")
                if queued > peak:
                    peak, peak_at = queued, time.strftime("%H:%M:%S", time.localtime(now))
            time.sleep(args.interval_s)
    print(f"listen queues: {samples} samples, {nonempty} with connections waiting; "
          f"most waiting {peak}{' at ' + peak_at if peak else ''}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
