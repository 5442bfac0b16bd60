"""`ProcessTransport.stop` on a busy machine: its timeout bounds the child's loop, not the
child's exit. An engine child's interpreter teardown (torch loaded) takes 2 s on an idle
2-core CPU and 12 s beside two busy processes: past the 5 s + 2 s that `AsyncLLM.shutdown`
gave the whole stop, which then killed a child exiting normally (exit -9)."""

from __future__ import annotations

import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from sits.config import EngineConfig
from sits.engine import process_transport
from sits.engine.messages import Ready, Stop

_TEARDOWN_S = 4.0  # the stand-in's exit after its loop ended: longer than terminate + kill's 2 s


def _slow_exit_child(cmd_conn: Connection, out_conn: Connection, *_: Any) -> None:
    """Stands in for `run_engine_proc`: `Ready`, then on `Stop` close the event pipe (the loop
    is over) and take `_TEARDOWN_S` to exit, as a slow teardown does; SIGTERM is ignored as
    in the engine child."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out_conn.send(Ready(None, None))  # type: ignore[arg-type]
    assert isinstance(cmd_conn.recv(), Stop)
    out_conn.close()
    time.sleep(_TEARDOWN_S)


def test_stop_lets_a_child_whose_loop_ended_finish_its_exit(monkeypatch) -> None:
    monkeypatch.setattr(process_transport, "run_engine_proc", _slow_exit_child)
    config = EngineConfig(model="unused", skip_tokenizer_init=True)
    transport = process_transport.ProcessTransport(config, (), 0, False)
    closed: list[str] = []
    pipe_closed = threading.Event()
    transport.start(lambda event: None, lambda why: (closed.append(why), pipe_closed.set()))
    transport.send(Stop())
    assert pipe_closed.wait(600)  # ceiling for a hang only
    assert transport.exitcode is None  # still tearing down
    transport.stop(timeout_s=0.0)  # the loop has ended: no time left for it
    assert transport.exitcode == 0
    assert closed == ["the engine process exited (exit code None)"]
