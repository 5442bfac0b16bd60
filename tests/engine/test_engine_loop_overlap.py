"""The engine loop (both transports) writes a step's outputs while the device runs the next
step's forward (`EngineCore.step(while_gpu_runs)`), and writes them at once when no step
follows; new requests join during the forward, other commands after the step."""

from __future__ import annotations

import types

from sits import LLM
from sits.core.sampling_params import SamplingParams
from sits.engine.async_llm import AsyncLLM
from sits.engine.engine_loop import EngineLoop
from sits.engine.messages import AddRequest, EngineCall, FinishRequests, StatsUpdate, StepOutputs
from sits.engine.output_processor import make_engine_requests
from sits.engine.stats import EngineStats
from sits.engine.step_watch import StepWatch
from tests.engine.fake_pipes import Inbox

_NO_TIMES = types.SimpleNamespace(mark=lambda step_started_s, typical_step_s=0.0: None)


def _proc(log: list[str], num_steps: int, device_steps: set[int]) -> EngineLoop:
    """An `EngineLoop` around a fake driver: step k "launches" its forward, runs the
    callback only when k is in `device_steps`, then "syncs"; idle after `num_steps`."""
    proc = object.__new__(EngineLoop)
    state = types.SimpleNamespace(step=0)

    class Core:
        scheduler = types.SimpleNamespace(num_running=1, num_waiting=0)

        def has_unfinished_requests(self) -> bool:
            return state.step < num_steps

    class Driver:
        stats = types.SimpleNamespace(num_running=1, num_waiting=0)

        def step(self, while_gpu_runs=None) -> tuple[list, bool]:
            state.step += 1
            log.append(f"launch {state.step}")
            if while_gpu_runs is not None and state.step in device_steps:
                while_gpu_runs()
            log.append(f"sync {state.step}")
            return [f"out{state.step}"], False

    class Conn:
        def send(self, event: StepOutputs) -> None:
            log.append(f"sent {event.outputs[0]}")

    def drain(block: bool) -> None:
        if block:  # idle: the test's end
            proc.stopping = True

    proc.core, proc.driver, proc.events = Core(), Driver(), Conn()
    proc.commands = Inbox([])
    proc.loop_times, proc.pending, proc.stopping = _NO_TIMES, None, False
    proc.deferred, proc.took_adds = [], False
    proc.stats_time_s = 0.0
    proc.step_watch = StepWatch()
    proc.drain = drain
    proc.snapshot = lambda force: None
    proc.profile = types.SimpleNamespace(
        mark=lambda: None, lap=lambda name: None, maybe_log=lambda: 0
    )
    return proc


def test_a_steps_outputs_are_written_during_the_next_steps_forward() -> None:
    log: list[str] = []
    _proc(log, num_steps=3, device_steps={1, 2, 3}).run()
    assert log == [
        "launch 1", "sync 1",
        "launch 2", "sent out1", "sync 2",  # step 1's outputs go while step 2 runs
        "launch 3", "sent out2", "sync 3",
        "sent out3",  # no step follows: written before the loop waits for commands
    ]  # fmt: skip


def test_a_step_without_a_device_phase_writes_the_one_before_after_it() -> None:
    log: list[str] = []
    _proc(log, num_steps=3, device_steps={1, 3}).run()
    assert log == [
        "launch 1", "sync 1",
        "launch 2", "sync 2", "sent out1",  # step 2 ran nothing on the device
        "launch 3", "sent out2", "sync 3",
        "sent out3",
    ]  # fmt: skip


def test_the_front_end_keeps_the_newest_stats_snapshot() -> None:
    engine = object.__new__(AsyncLLM)
    engine._stats = EngineStats(num_waiting=5, time_s=10.0)
    engine._on_event(StatsUpdate(EngineStats(num_waiting=7, time_s=12.0)))
    engine._on_event(StepOutputs([], EngineStats(num_waiting=6, time_s=11.0)))  # overtaken
    assert engine._stats.num_waiting == 7
    engine._on_event(StepOutputs([], EngineStats(num_waiting=8, time_s=13.0)))
    assert engine._stats.num_waiting == 8


def test_core_step_runs_the_host_work_once_after_the_forward(tiny_model_factory) -> None:
    llm = LLM(model=str(tiny_model_factory("qwen3_moe")), dtype="float32", max_model_len=128)
    core = llm.engine_core
    runner = core.runner
    order: list[str] = []
    forward = runner._forward

    def recorded_forward(plan):
        order.append("forward")
        return forward(plan)

    runner._forward = recorded_forward
    assert core.step(lambda: order.append("host")) == [] and order == []  # nothing scheduled
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for child in make_engine_requests(
        "r", [1, 2, 3, 4], params, eos_token_ids=(), max_model_len=128, enable_prefix_caching=True
    ):
        core.add_request(child)
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for out in core.step(lambda: order.append("host")) for t in out.new_token_ids]
    assert len(tokens) == 3
    assert order == ["forward", "host"] * 3


_NAMES = {AddRequest: "add", FinishRequests: "finish", EngineCall: "call"}


def _kind(command: object) -> str:
    """A command's short name and first field, e.g. "add a" for `AddRequest("a", ())`."""
    first = getattr(command, command.__match_args__[0])
    return f"{_NAMES[type(command)]} {first[0] if isinstance(first, tuple) else first}"


def _inbox_proc(commands: list[object], handled: list[str]) -> EngineLoop:
    """An `EngineLoop` with the real `while_gpu_runs` and `drain` over an inbox of commands;
    `handle` records each command's kind and first field."""
    proc = object.__new__(EngineLoop)
    proc.commands = Inbox(commands)
    proc.events = types.SimpleNamespace(send=lambda event: handled.append(type(event).__name__))
    proc.pending, proc.stopping, proc.deferred, proc.took_adds = None, False, [], False
    proc.core = types.SimpleNamespace(has_unfinished_requests=lambda: True)
    proc.snapshot = lambda force: None
    proc.profile = types.SimpleNamespace(add=lambda name, seconds: None)
    proc.handle = lambda command: handled.append(_kind(command))
    return proc


def test_new_requests_are_taken_during_the_forward_and_other_commands_after_the_step() -> None:
    handled: list[str] = []
    add = [AddRequest(request_id, ()) for request_id in "abc"]
    finish, call = FinishRequests(("a",)), EngineCall(1, "expert_stats")
    commands = [add[0], add[1], finish, add[2], call]
    proc = _inbox_proc(commands, handled)
    proc.while_gpu_runs()
    # The abort frees blocks the running step may write: it and all after it wait.
    assert handled == ["add a", "add b"] and proc.took_adds
    assert proc.deferred == [finish] and commands == [add[2], call]
    proc.while_gpu_runs()  # a later forward before the drain takes nothing past the wait
    assert handled == ["add a", "add b"]
    proc.drain(block=False)
    assert handled == ["add a", "add b", "finish a", "add c", "call 1"]
    assert proc.deferred == [] and commands == []


def test_a_stalled_step_that_took_new_requests_steps_again_without_waiting() -> None:
    log: list[str] = []
    proc = _proc(log, num_steps=2, device_steps={1, 2})
    proc.commands = Inbox([AddRequest("x", ())])
    proc.handle = lambda command: log.append(f"handle {command.request_id}")
    waits: list[bool] = []

    def drain(block: bool) -> None:
        waits.append(block)
        if block:
            proc.stopping = True

    proc.drain = drain
    stalled_step = proc.driver.step

    def step(while_gpu_runs=None) -> tuple[list, bool]:
        outputs, _ = stalled_step(while_gpu_runs)
        return outputs, True  # every step stalls (no request could run)

    proc.driver.step = step
    proc.run()
    assert log[:4] == ["launch 1", "handle x", "sync 1", "launch 2"]
    # Before step 1, after it (it took x: step again at once), after step 2 (stalled: wait).
    assert waits == [False, False, True]
