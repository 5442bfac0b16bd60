"""The pipes between the server process and the engine process never stall either side: the
server's sends go through one writer thread (a full pipe cannot block the event loop), and the
engine loop handles commands for at most `MAX_DRAIN_S` between two steps."""

from __future__ import annotations

import queue
import threading

import sits.engine.engine_loop as engine_loop
from sits.engine.messages import AddRequest, StatsUpdate
from sits.engine.process_transport import ProcessTransport
from tests.engine.fake_pipes import Inbox
from tests.waits import HANG_S


class _BlockingConn:
    """A pipe end whose sends block until `release` is set (a full pipe)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sent: list[object] = []

    def send(self, command: object) -> None:
        self.release.wait()
        self.sent.append(command)


def _writer_side(conn: object) -> ProcessTransport:
    """A `ProcessTransport`'s writer side alone (no child process)."""
    transport = object.__new__(ProcessTransport)
    transport._outbox = queue.SimpleQueue()
    transport._cmd_conn = conn
    return transport


def test_sends_never_block_the_caller_and_keep_their_order() -> None:
    transport = _writer_side(conn := _BlockingConn())
    writer = threading.Thread(target=transport._write_loop, daemon=True)
    writer.start()
    caller = threading.Thread(
        target=lambda: [transport.send(AddRequest(f"r{i}", ())) for i in range(1000)]
    )
    caller.start()
    caller.join(HANG_S)
    assert not caller.is_alive()  # the writer is blocked; the caller never was
    assert conn.sent == []
    conn.release.set()
    transport._outbox.put(None)
    writer.join(HANG_S)
    assert not writer.is_alive()
    assert conn.sent == [AddRequest(f"r{i}", ()) for i in range(1000)]


def test_a_closed_pipe_ends_the_writer_quietly() -> None:
    class Closed:
        def send(self, command: object) -> None:
            raise OSError("pipe closed")

    transport = _writer_side(Closed())
    transport.send(AddRequest("r0", ()))
    transport._write_loop()  # returns instead of raising


def test_drain_handles_commands_for_at_most_max_drain_s(monkeypatch) -> None:
    assert 0 < engine_loop.MAX_DRAIN_S <= 0.1
    clock = [100.0]
    monkeypatch.setattr(engine_loop.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(engine_loop, "MAX_DRAIN_S", 64 / 1024)  # binary fractions: exact sums

    class Outbox:
        def __init__(self) -> None:
            self.events: list[object] = []

        def send(self, event: object) -> None:
            self.events.append(event)

    loop = object.__new__(engine_loop.EngineLoop)
    loop.commands = Inbox([AddRequest(f"r{i}", ()) for i in range(200)])
    loop.events = Outbox()
    loop.stopping, loop.deferred = False, []
    loop.core = type("Core", (), {"has_unfinished_requests": lambda self: True})()
    handled: list[object] = []

    def handle(command: object) -> None:
        handled.append(command)
        clock[0] += 1 / 1024  # each command takes ~1 ms

    loop.handle = handle
    timed: list[tuple[str, float]] = []
    loop.profile = type("Profile", (), {"add": lambda self, *phase_s: timed.append(phase_s)})()
    forced: list[bool] = []
    loop.snapshot = lambda force: forced.append(force) or "snapshot"
    loop.drain(block=False)
    assert len(handled) == 64  # stopped at the bound...
    assert timed == [("commands", 64 / 1024)]  # the loop profile got the drain's time
    # ...then steps; between busy steps no snapshot: the next step's end sends one.
    assert loop.events.events == [] and forced == []
    loop.drain(block=False)
    assert len(handled) == 2 * 64  # the rest waits for the next drain
    assert handled == [AddRequest(f"r{i}", ()) for i in range(len(handled))]
    loop.drain(block=True)  # after an idle wait: a fresh snapshot (the per-tenant scan too)
    assert forced == [True] and loop.events.events == [StatsUpdate("snapshot")]
    loop.core = type("Core", (), {"has_unfinished_requests": lambda self: False})()
    loop.drain(block=False)  # the commands left the engine idle: no step will refresh it
    assert forced == [True, True]
