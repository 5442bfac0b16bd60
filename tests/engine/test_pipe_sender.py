"""The engine process's threaded pipe writer: order, flush on close, backpressure, failures."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from sits.engine.pipe_sender import PipeSender


def test_messages_arrive_in_order_and_close_writes_what_is_queued() -> None:
    recv_conn, send_conn = multiprocessing.Pipe(duplex=False)
    sender = PipeSender(send_conn, max_pending=4)
    received: list[tuple] = []
    reader = threading.Thread(target=lambda: received.extend(recv_conn.recv() for _ in range(500)))
    reader.start()
    for i in range(500):
        sender.send(("step", i, [i] * 3))
    assert sender.close()
    reader.join(5)
    assert received == [("step", i, [i] * 3) for i in range(500)]
    with pytest.raises(RuntimeError):
        sender.send(("late",))
    with pytest.raises(ValueError):
        PipeSender(send_conn, max_pending=0)


def test_a_reader_that_stops_reading_blocks_the_sender_at_max_pending() -> None:
    class StuckConn:
        def __init__(self) -> None:
            self.release = threading.Event()
            self.sent: list[int] = []

        def send(self, message: int) -> None:
            self.release.wait()
            self.sent.append(message)

    conn = StuckConn()
    sender = PipeSender(conn, max_pending=2)  # type: ignore[arg-type]
    queued: list[int] = []

    def produce() -> None:
        for i in range(5):
            sender.send(i)
            queued.append(i)

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(0.5)
    # One message is in the stuck write, two wait in the queue: the fourth send blocks.
    assert producer.is_alive() and queued == [0, 1, 2]
    conn.release.set()
    producer.join(5)
    assert sender.close() and conn.sent == [0, 1, 2, 3, 4]


def test_a_failed_write_is_raised_by_the_next_send() -> None:
    recv_conn, send_conn = multiprocessing.Pipe(duplex=False)
    recv_conn.close()
    sender = PipeSender(send_conn)
    sender.send(("step", 1))  # queued; the write fails on the thread (the reader is gone)
    assert not sender.close()
    sender = PipeSender(send_conn)
    sender.send(("step", 1))
    for _ in range(1000):  # the thread's write fails soon after
        if sender._error is not None:
            break
        threading.Event().wait(0.005)
    with pytest.raises(BrokenPipeError):
        sender.send(("step", 2))
    assert not sender.close()
