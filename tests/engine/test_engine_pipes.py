"""The pipes between the server process and the engine process never stall either side: the
server's sends go through one writer thread (a full pipe cannot block the event loop), and the
engine handles commands for at most `MAX_DRAIN_S` between two steps."""

from __future__ import annotations

import queue
import threading
import time

import sits.engine.engine_proc as engine_proc
from sits.engine.async_mp import AsyncMPLLM
from tests.engine.fake_pipes import Inbox


class _BlockingConn:
    """A pipe end whose sends block until `release` is set (a full pipe)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[tuple] = []

    def send(self, command: tuple) -> None:
        self.release.wait()
        self.sent.append(command)


def test_sends_never_block_the_caller_and_keep_their_order() -> None:
    engine = object.__new__(AsyncMPLLM)  # only the writer side: no child process
    engine._outbox = queue.SimpleQueue()
    engine._cmd_conn = conn = _BlockingConn()
    writer = threading.Thread(target=engine._write_loop, daemon=True)
    writer.start()
    start = time.monotonic()
    for i in range(1000):
        engine._send(("add", f"r{i}"))
    assert time.monotonic() - start < 5.0  # the writer is blocked; the caller never was
    assert conn.sent == []
    conn.release.set()
    engine._outbox.put(None)
    writer.join(5.0)
    assert not writer.is_alive()
    assert conn.sent == [("add", f"r{i}") for i in range(1000)]


def test_a_closed_pipe_ends_the_writer_quietly() -> None:
    class Closed:
        def send(self, command: tuple) -> None:
            raise OSError("pipe closed")

    engine = object.__new__(AsyncMPLLM)
    engine._outbox = queue.SimpleQueue()
    engine._cmd_conn = Closed()
    engine._send(("add", "r0"))
    engine._write_loop()  # returns instead of raising


def test_drain_handles_commands_for_at_most_max_drain_s(monkeypatch) -> None:
    assert 0 < engine_proc.MAX_DRAIN_S <= 0.1
    clock = [100.0]
    monkeypatch.setattr(engine_proc.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(engine_proc, "MAX_DRAIN_S", 64 / 1024)  # binary fractions: exact sums

    class Outbox:
        def __init__(self) -> None:
            self.messages: list[tuple] = []

        def send(self, message: tuple) -> None:
            self.messages.append(message)

    proc = object.__new__(engine_proc._EngineProc)
    proc.cmd_conn = Inbox([("add", f"r{i}") for i in range(200)])
    proc.out_conn = Outbox()
    proc.stopping, proc.deferred = False, []
    proc.core = type("Core", (), {"has_unfinished_requests": lambda self: True})()
    handled: list[tuple] = []

    def handle(command: tuple) -> None:
        handled.append(command)
        clock[0] += 1 / 1024  # each command takes ~1 ms

    proc.handle = handle
    timed: list[tuple[str, float]] = []
    proc.profile = type("Profile", (), {"add": lambda self, *phase_s: timed.append(phase_s)})()
    forced: list[bool] = []
    proc.snapshot = lambda force: forced.append(force) or "snapshot"
    proc.drain(block=False)
    assert len(handled) == 64  # stopped at the bound...
    assert timed == [("commands", 64 / 1024)]  # the loop profile got the drain's time
    # ...then steps; between busy steps no snapshot: the next step's end sends one.
    assert proc.out_conn.messages == [] and forced == []
    proc.drain(block=False)
    assert len(handled) == 2 * 64  # the rest waits for the next drain
    assert handled == [("add", f"r{i}") for i in range(len(handled))]
    proc.drain(block=True)  # after an idle wait: a fresh snapshot (the per-tenant scan too)
    assert forced == [True] and proc.out_conn.messages == [("stats", "snapshot")]
    proc.core = type("Core", (), {"has_unfinished_requests": lambda self: False})()
    proc.drain(block=False)  # the commands left the engine idle: no step will refresh it
    assert forced == [True, True]
