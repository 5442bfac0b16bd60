"""sits.bench.listen_queue: accept-queue lengths read from /proc/net/tcp."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from sits.bench import listen_queue

ROOT = Path(__file__).resolve().parents[2]
TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:B67B 00000000:0000 0A 00000800:00000005 00:00000000 00000000     0        0 1 1 0
   1: 0100007F:1F90 0100007F:D1C2 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0
   2: 00000000:07E8 00000000:0000 0A 00001000:00000000 00:00000000 00000000     0        0 3 1 0
"""


def test_listen_rows_give_port_queued_and_limit() -> None:
    # the established row (state 01) is skipped; 0xB67B = 46715, 0x07E8 = 2024
    assert listen_queue.listen_queues(TABLE) == [(46715, 5), (2024, 0)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_connections_nobody_accepts_are_counted() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        assert listen_queue.sample(port) == [(port, 3)]
        listener.accept()[0].close()
        assert listen_queue.sample(port) == [(port, 2)]
    finally:
        for client in clients:
            client.close()
        listener.close()
