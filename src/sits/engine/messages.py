"""The messages between the engine front end (`AsyncLLM`) and the engine loop (`EngineLoop`).

Both transports (`sits.engine.thread_transport`, `sits.engine.process_transport`) carry the
same messages: commands from the front end to the loop, events back. Every message is a
frozen, slotted dataclass that pickles (the process transport sends them over pipes); none
holds a closure or a future. An engine call is named (`EngineCall.name`, one of `CALL_NAMES`)
and answered by a `CallResult` with its call id. Exceptions travel as `PackedError`, which
rebuilds the exception's class, args and attributes on the other side.

Startup (process transport only): the child sends `Ready` once the engine is built, or
`StartupError`.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sits.core.outputs import EngineCoreOutput
from sits.core.request import FinishReason, Request
from sits.sched.config import TenantTier

if TYPE_CHECKING:
    from sits.engine.stats import EngineStats
    from sits.runner.model_info import ModelInfo

# The loop methods an `EngineCall` may name (`EngineLoop.call`).
CALL_NAMES = frozenset(
    {
        "expert_stats",
        "freeze_expert",
        "unfreeze_expert",
        "restore_expert",
        "prefill_chunks",
        "set_precision",
    }
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
    attrs: Mapping[str, Any]
    text: str


def pack_error(exc: BaseException) -> PackedError:
    """`exc` as a `PackedError` (attributes that do not pickle are left out)."""
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


# ---- commands: front end -> loop --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue one request's engine requests (one per sample; `make_engine_requests`).

    A request the core refuses (`EngineCore.add_request` raises a SitsError) is answered with
    `AddFailed`; its children are finished.
    """

    request_id: str
    children: tuple[Request, ...]


@dataclass(frozen=True, slots=True)
class FinishRequests:
    """Finish engine requests from outside (abort, stop string; `EngineCore.finish_requests`)."""

    request_ids: tuple[str, ...]
    reason: FinishReason = FinishReason.ABORT
    stop_reason: int | str | None = None


@dataclass(frozen=True, slots=True)
class SetBorrowingTiers:
    """Let only tenants of `tiers` borrow beyond their reservation (overload control)."""

    tiers: frozenset[TenantTier]


@dataclass(frozen=True, slots=True)
class RecordTimeline:
    """Stamp each request's prompt chunks on its metrics (`StepStats.record_request_chunks`)."""

    enabled: bool


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Run loop method `name` (one of `CALL_NAMES`) with `args` between steps; answered by a
    `CallResult` of the same `call_id`.

    Raises:
        ValueError: an unknown name.
    """

    call_id: int
    name: str
    args: tuple = ()

    def __post_init__(self) -> None:
        if self.name not in CALL_NAMES:
            raise ValueError(f"unknown engine call {self.name!r}")


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop the loop (after writing the last step's outputs)."""


Command = AddRequest | FinishRequests | SetBorrowingTiers | RecordTimeline | EngineCall | Stop


# ---- events: loop -> front end ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """One step's outputs, with a fresh stats snapshot when one was due (else None)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats | None


@dataclass(frozen=True, slots=True)
class StatsUpdate:
    """A stats snapshot taken between steps (after commands, before a call's result)."""

    stats: EngineStats


@dataclass(frozen=True, slots=True)
class AddFailed:
    """The core refused request `request_id` (`AddRequest`); `error` is why."""

    request_id: str
    error: PackedError


@dataclass(frozen=True, slots=True)
class CallResult:
    """The answer to `EngineCall` `call_id`: its value when `ok`, else a `PackedError`."""

    call_id: int
    ok: bool
    value: Any


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Sent when the loop's idle wait found no command: the loop still turns."""


@dataclass(frozen=True, slots=True)
class EngineDied:
    """The loop failed with `error` and stops; nothing follows."""

    error: PackedError


@dataclass(frozen=True, slots=True)
class Ready:
    """Startup done (process transport): the model's info and the first stats snapshot."""

    info: ModelInfo
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class StartupError:
    """Building the engine failed (process transport); the child exits."""

    error: PackedError


Event = StepOutputs | StatsUpdate | AddFailed | CallResult | Heartbeat | EngineDied
