"""The engine process of `AsyncMPLLM`: builds the `EngineCore` and runs its step loop.

`run_engine_proc` is the target of a "spawn" child process (so CUDA initialises in the child).
It talks to the parent over two one-way `multiprocessing` pipes, with pickled tuples whose
first item is the kind:

parent -> child: ("add", request_id, children), ("finish", child_ids, FinishReason,
stop_reason), ("borrowing", frozenset[TenantTier]), ("timeline", enabled),
("call", call_id, name, args) with name one of `CALL_NAMES`, ("stop",).

child -> parent: first ("ready", ModelInfo, EngineStats) or ("startup_error", PackedError);
then ("step", outputs, EngineStats | None) after a step that produced outputs or a due
snapshot, ("stats", EngineStats) after a batch of commands and before each call's result,
("add_failed", request_id, PackedError), ("result", call_id, ok, value | PackedError),
("beat",) every `_IDLE_WAIT_S` while idle (the parent's health heartbeat) and ("died",
PackedError) when the loop fails.

The loop keeps `AsyncLLM._engine_loop`'s rules: block on the inbox while idle or stalled,
read the MoE expert counters as `EngineDriver` does (the same code), and
snapshot the stats after a batch of commands that ends an idle wait or leaves the engine
idle, when idle, when a step changed the number of running or waiting requests, and else
every `_STATS_PERIOD_S` while stepping. A step's
("step", ...) message is written during the next step, once its forward is launched
(`EngineCore.step`'s `while_gpu_runs`): the pickling and the pipe write (~1.5-2 ms per step on
the H200's host) then overlap the device's work instead of lengthening every step, which under
TPOT pacing is batch given up. It is written at once when no step follows (idle, stalled,
stopping, dying). The commands queued by then are read in the same shadow: new requests join
the waiting queues at once (under load about four per step, ~1 ms of host work that each step
paid before), any other command waits for the step's end (`_EngineProc.while_gpu_runs`).
So a ("stats", ...) sent after commands can overtake an older step's message; the parent
keeps the newest snapshot by `EngineStats.time_s`. The child ignores SIGINT and SIGTERM (the
parent owns shutdown; it kills a child that does not stop) and exits when the parent's end of
the command pipe closes. Timestamps (`time.monotonic()`) are comparable between the two
processes: one system-wide clock on Linux.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from sits.config import EngineConfig
from sits.core.errors import SitsError
from sits.engine.async_llm import _IDLE_WAIT_S, EngineStats
from sits.engine.driver import EngineDriver, force_after_commands
from sits.engine.loop_profile import LoopProfile
from sits.obs.gc_pauses import GcPauseMonitor, freeze_startup_heap
from sits.sched.config import TenantPolicy

logger = logging.getLogger(__name__)

_STATS_PERIOD_S = 0.02
MAX_DRAIN_S = 0.05  # longest run of command handling between two steps, seconds
CALL_NAMES = (
    "expert_stats",
    "freeze_expert",
    "unfreeze_expert",
    "restore_expert",
    "prefill_chunks",
    "set_precision",
)


@dataclass(frozen=True, slots=True)
class PackedError:
    """An exception in a form that survives pickling (its class may not: e.g.
    `InvalidParameterError(param, message)` pickles its args as (message,) only).

    Attributes:
        module, qualname: where its class lives.
        args: the exception's `args`.
        attrs: its instance `__dict__` (e.g. `param`).
        text: `repr()` of the exception, for the fallback.
    """

    module: str
    qualname: str
    args: tuple
    attrs: dict[str, Any]
    text: str


def pack_error(exc: BaseException) -> PackedError:
    """`exc` as a `PackedError` (attributes that do not pickle are left out)."""
    import pickle

    attrs = {}
    for key, value in getattr(exc, "__dict__", {}).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - drop what cannot travel
            continue
        attrs[key] = value
    try:
        args = tuple(exc.args)
        pickle.dumps(args)
    except Exception:  # noqa: BLE001
        args = (str(exc),)
    cls = type(exc)
    return PackedError(cls.__module__, cls.__qualname__, args, attrs, repr(exc))


def unpack_error(packed: PackedError) -> BaseException:
    """The exception of `packed`: same class, args and attributes; a RuntimeError naming it
    when the class cannot be rebuilt."""
    try:
        cls: Any = importlib.import_module(packed.module)
        for part in packed.qualname.split("."):
            cls = getattr(cls, part)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(packed.qualname)
        exc = cls.__new__(cls, *packed.args)
        exc.args = packed.args
        for key, value in packed.attrs.items():
            setattr(exc, key, value)
        return exc
    except Exception:  # noqa: BLE001 - any rebuild failure falls back to the text
        return RuntimeError(f"engine process error: {packed.text}")


def run_engine_proc(
    cmd_conn: Connection,
    out_conn: Connection,
    loop_times: Any,
    config: EngineConfig,
    tenant_policies: tuple[TenantPolicy, ...],
    expert_freeze_after: int,
    restore_frozen_experts: bool,
    log_level: int,
) -> None:
    """Child process entry: build the engine, report ("ready" or "startup_error"), then run
    the step loop until ("stop",) or the parent goes away. `loop_times` is a shared
    `multiprocessing.Array("d", 2)` the loop keeps at (start of the running step or 0, last
    turn of the loop), in time.monotonic() seconds, for the parent's health check."""
    # The parent owns shutdown: a Ctrl-C or a SIGTERM sent to the whole process group (as
    # `systemctl stop` does) must not kill the engine under the parent's draining requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    logging.getLogger("sits").setLevel(log_level)
    try:
        proc = _EngineProc(
            cmd_conn,
            out_conn,
            config,
            tenant_policies,
            expert_freeze_after,
            restore_frozen_experts,
            loop_times,
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent's constructor
        if not isinstance(exc, SitsError):  # a user error is reported by the parent alone
            logger.exception("engine startup failed")
        _send_quietly(out_conn, ("startup_error", pack_error(exc)))
        return
    frozen = freeze_startup_heap()  # the engine is built: none of it is garbage
    logger.info("froze %d startup objects out of garbage collection", frozen)
    pauses = GcPauseMonitor(where="engine").install()
    out_conn.send(("ready", proc.info, proc.stats))
    try:
        proc.run()
    finally:
        pauses.close()
        gc.unfreeze()  # exit with a collectable heap (extensions report frozen objects as leaks)


def _send_quietly(conn: Connection, message: tuple) -> None:
    with contextlib.suppress(OSError, ValueError):  # the parent is gone
        conn.send(message)


class _EngineProc:
    """The child's engine and its step loop (one thread)."""

    def __init__(
        self,
        cmd_conn: Connection,
        out_conn: Connection,
        config: EngineConfig,
        tenant_policies: tuple[TenantPolicy, ...],
        expert_freeze_after: int,
        restore_frozen_experts: bool,
        loop_times: Any = None,
    ) -> None:
        import dataclasses

        from sits.engine.builder import build_engine

        # The parent keeps the tokenizer; the child never detokenizes.
        parts = build_engine(dataclasses.replace(config, skip_tokenizer_init=True), tenant_policies)
        self.core = parts.core
        self.info = parts.info
        self.cmd_conn = cmd_conn
        self.out_conn = out_conn
        self.stopping = False
        self.driver = EngineDriver(
            parts.core, parts.info, config, expert_freeze_after, restore_frozen_experts
        )
        self.stats_time_s = time.monotonic()
        self.profile = LoopProfile(parts.core)
        self.loop_times = loop_times
        self.pending: tuple | None = None  # the last step's message, written during the next
        self.deferred: list[tuple] = []  # commands read during a step, handled after it
        self.took_adds = False  # the running step's forward took new requests

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot."""
        return self.driver.stats

    def mark_loop(self, step_started_s: float) -> None:
        """Publish the loop's times (`run_engine_proc`): the running step's start (0: none)
        and now as its last turn."""
        times = self.loop_times
        if times is not None:
            with times.get_lock():
                times[:] = (step_started_s, time.monotonic())

    def run(self) -> None:
        """The step loop (see the module docstring); sends ("died", ...) when it fails."""
        core = self.core
        sched = core.scheduler
        profile = self.profile
        stalled = False
        try:
            while not self.stopping:
                self.mark_loop(0.0)
                idle = stalled or not core.has_unfinished_requests()
                if idle:
                    self.flush()  # no step follows soon: the last one's outputs go now
                self.drain(block=idle)
                if self.stopping or not core.has_unfinished_requests():
                    continue
                profile.mark()
                self.mark_loop(time.monotonic())
                # The last step's outputs are written, and new requests taken, while the
                # device runs this one.
                self.took_adds = False
                outputs, stalled = self.driver.step(self.while_gpu_runs)
                self.mark_loop(0.0)
                profile.lap("step")
                stalled = stalled and not self.took_adds  # stalled: wait for a command
                idle = stalled or not core.has_unfinished_requests()
                due = (
                    idle
                    or time.monotonic() - self.stats_time_s >= _STATS_PERIOD_S
                    or (sched.num_running, sched.num_waiting)
                    != (self.stats.num_running, self.stats.num_waiting)
                )
                stats = self.snapshot(force=idle) if due else None
                profile.lap("stats")
                self.flush()  # a step with no device phase did not write the one before
                if outputs or stats is not None:
                    self.pending = ("step", outputs, stats)
                profile.lap("send")
                profile.maybe_log()
            self.flush()
        except (EOFError, BrokenPipeError):
            logger.info("engine process: the server process is gone; exiting")
        except BaseException as exc:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop died")
            if self.pending is not None:
                _send_quietly(self.out_conn, self.pending)
            _send_quietly(self.out_conn, ("died", pack_error(exc)))
            raise SystemExit(1) from None

    def flush(self) -> None:
        """Write the pending ("step", ...) message, if any (see `run`)."""
        message, self.pending = self.pending, None
        if message is not None:
            self.out_conn.send(message)

    def while_gpu_runs(self) -> None:
        """Host work in the shadow of a step's forward: write the last step's message, then
        read the queued commands for at most `MAX_DRAIN_S`. New requests ("add") only join
        the waiting queues, which the running step does not read, so they are handled at
        once; the first other command (an abort frees blocks the step is writing, an expert
        operation changes weights it reads) and everything after it wait in `deferred` for
        the drain after the step, keeping the commands' order."""
        self.flush()
        conn = self.cmd_conn
        deadline_s = time.monotonic() + MAX_DRAIN_S
        while not self.deferred and conn.poll(0) and time.monotonic() < deadline_s:
            command = conn.recv()
            if command[0] != "add":
                self.deferred.append(command)
                return
            self.handle(command)
            self.took_adds = True

    def drain(self, block: bool) -> None:
        """Handle the deferred and queued commands (waiting up to `_IDLE_WAIT_S` for one when
        `block` and none was deferred) for at most `MAX_DRAIN_S`; a ("beat",) when the wait
        found none. The bound keeps a flood of commands from holding the steps (and the
        heartbeat they carry) back: the rest waits for the next drain, one step later.

        After an idle wait, or when the commands left nothing to run, a fresh snapshot
        follows (`force_after_commands`). Between busy steps none does: the step that follows
        at once sends one at its end (the counts changed, or `_STATS_PERIOD_S` passed), and a
        snapshot here (~0.3 ms on the H200's host) came out of every paced step."""
        conn = self.cmd_conn
        if not self.deferred and not conn.poll(_IDLE_WAIT_S if block else 0):
            if block:
                self.out_conn.send(("beat",))
            return
        start_s = time.monotonic()
        deadline_s = start_s + MAX_DRAIN_S
        while self.deferred and not self.stopping:
            self.handle(self.deferred.pop(0))
        while not self.stopping and conn.poll(0) and time.monotonic() < deadline_s:
            self.handle(conn.recv())
        if force_after_commands(block, self.core):
            self.out_conn.send(("stats", self.snapshot(force=True)))
        self.profile.add("commands", time.monotonic() - start_s)

    def handle(self, command: tuple) -> None:
        kind = command[0]
        core = self.core
        if kind == "add":
            _, request_id, children = command
            try:
                for child in children:
                    core.add_request(child)
            except SitsError as exc:  # a request that can never be served; not a loop failure
                core.finish_requests([c.request_id for c in children])
                self.out_conn.send(("add_failed", request_id, pack_error(exc)))
        elif kind == "finish":
            _, ids, reason, stop_reason = command
            core.finish_requests(ids, reason, stop_reason)
        elif kind == "borrowing":
            self.driver.set_borrowing_tiers(command[1])
        elif kind == "timeline":
            core.stats.record_request_chunks = bool(command[1])
        elif kind == "call":
            _, call_id, name, args = command
            try:
                message = ("result", call_id, True, self.call(name, args))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                message = ("result", call_id, False, pack_error(exc))
            # Stats first: once the caller has its result, stats() shows the call's effect.
            self.out_conn.send(("stats", self.snapshot(force=False)))
            self.out_conn.send(message)
        elif kind == "stop":
            self.stopping = True

    def call(self, name: str, args: tuple) -> Any:
        """The named call of `AsyncMPLLM` (expert surface, prefill chunks, precision)."""
        if name == "prefill_chunks":
            return list(self.core.stats.prefill_chunks)
        if name == "set_precision":
            return self.core.set_precision(*args)  # (name, the parent's time.monotonic())
        if name == "expert_stats":
            return self.driver.read_experts()
        if name not in ("freeze_expert", "unfreeze_expert", "restore_expert"):
            raise ValueError(f"unknown engine call {name!r}")
        return self.driver.expert_operation(name.removesuffix("_expert"), *args)

    def snapshot(self, force: bool) -> EngineStats:
        """A fresh stats snapshot (`EngineDriver.snapshot`), noting when it was taken."""
        self.stats_time_s = time.monotonic()
        return self.driver.snapshot(force)
