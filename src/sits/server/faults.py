"""Fault injection for tests and chaos drills (`sits serve --fault-injection SPEC`), after
Envoy's HTTP fault filter: delays, error answers and hangs on a share of the generation
requests, so a router's breaker, fallback and canary can be driven by real replicas.

SPEC is comma-separated items, each kind at most once:
- `delay=SECONDS@PERCENT`: wait SECONDS (>= 0) before serving the request;
- `abort=STATUS@PERCENT`: answer HTTP STATUS (400-599) with an OpenAI error body, code
  "fault_injected", instead of serving;
- `hang@PERCENT`: never answer, until the client disconnects or the server drains (then a 503
  "draining" as any request refused by the drain).
PERCENT is in [0, 100]. Off by default; the CLI refuses SPEC unless `--enable-fault-injection`
is also given.

Decisions are exact for a seed: for each POST to /v1/completions or /v1/chat/completions (no
other route is touched), `FaultInjector.decide` draws one `random.Random(seed).random()` per
item, in SPEC order, and the item fires when `draw * 100 < PERCENT`. A fired delay is served
first; then a fired hang wins over a fired abort. Faults apply before authentication, as
Envoy's filter runs before the upstream. Every fired item is counted in
`sits:fault_injected_total{kind}` (kind: delay, abort, hang).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter
from starlette.types import ASGIApp, Receive, Scope, Send

from sits.core.errors import InvalidParameterError
from sits.server.errors import ServerError, draining_error, error_response

FAULT_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
FAULT_CODE = "fault_injected"
_PARAM = "fault_injection"


class FaultKind(StrEnum):
    """A fault's kind (the `kind` label of `sits:fault_injected_total`)."""

    DELAY = "delay"
    ABORT = "abort"
    HANG = "hang"


@dataclass(frozen=True, slots=True)
class FaultItem:
    """One item of a fault spec.

    Attributes:
        kind: delay, abort or hang.
        percent: share of the requests it fires on, in [0, 100].
        delay_s: the delay, seconds (delay only; else 0).
        status: the HTTP status answered (abort only; else 0).
    """

    kind: FaultKind
    percent: float
    delay_s: float = 0.0
    status: int = 0


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """A parsed `--fault-injection` spec (`parse_fault_spec`) and its seed.

    Attributes:
        items: the items, in spec order (the order of the draws).
        seed: seed of the decisions' `random.Random` (`--fault-seed`).
    """

    items: tuple[FaultItem, ...]
    seed: int = 0

    def describe(self) -> str:
        """The spec as SPEC text (for the start-up warning)."""
        out = []
        for item in self.items:
            if item.kind is FaultKind.DELAY:
                out.append(f"delay={item.delay_s:g}@{item.percent:g}")
            elif item.kind is FaultKind.ABORT:
                out.append(f"abort={item.status}@{item.percent:g}")
            else:
                out.append(f"hang@{item.percent:g}")
        return ",".join(out)


def parse_fault_spec(text: str, seed: int = 0) -> FaultSpec:
    """Parse SPEC (see the module docstring).

    Raises:
        InvalidParameterError: (param "fault_injection") an empty spec, or an item that is
            malformed, repeats a kind, or has a value or percent out of range; the message
            names the item.
    """
    items: list[FaultItem] = []
    seen: set[FaultKind] = set()
    for raw in text.split(","):
        item = _parse_item(raw.strip())
        if item.kind in seen:
            raise InvalidParameterError(_PARAM, f"item {raw.strip()!r}: {item.kind} given twice")
        seen.add(item.kind)
        items.append(item)
    return FaultSpec(tuple(items), seed)


def _parse_item(item: str) -> FaultItem:
    def bad(why: str) -> InvalidParameterError:
        return InvalidParameterError(_PARAM, f"item {item!r}: {why}")

    head, at, percent_text = item.rpartition("@")
    if not at or not head:
        raise bad("expected delay=SECONDS@PERCENT, abort=STATUS@PERCENT or hang@PERCENT")
    percent = _number(percent_text)
    if percent is None or not 0 <= percent <= 100:
        raise bad(f"PERCENT must be a number in [0, 100], got {percent_text!r}")
    name, eq, value = head.partition("=")
    if name == "hang" and not eq:
        return FaultItem(FaultKind.HANG, percent)
    if name == "delay" and eq:
        seconds = _number(value)
        if seconds is None or seconds < 0:
            raise bad(f"SECONDS must be a number >= 0, got {value!r}")
        return FaultItem(FaultKind.DELAY, percent, delay_s=seconds)
    if name == "abort" and eq:
        if not value.isdigit() or not 400 <= int(value) <= 599:
            raise bad(f"STATUS must be an HTTP error status in 400-599, got {value!r}")
        return FaultItem(FaultKind.ABORT, percent, status=int(value))
    raise bad("expected delay=SECONDS@PERCENT, abort=STATUS@PERCENT or hang@PERCENT")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class FaultDecision:
    """What happens to one request.

    Attributes:
        delay_s: wait this long first (0: no delay fired).
        hang: never answer (until disconnect or drain).
        abort_status: answer this status instead of serving (None: no abort fired, or a hang).
    """

    delay_s: float = 0.0
    hang: bool = False
    abort_status: int | None = None


class FaultInjector:
    """Draws the decisions and counts the fired faults.

    Args:
        spec: the faults.
        registry: where `sits:fault_injected_total{model_name,kind}` is registered.
        model_name: its `model_name` label.
    """

    def __init__(self, spec: FaultSpec, registry: CollectorRegistry, model_name: str) -> None:
        self.spec = spec
        self._random = random.Random(spec.seed)
        self._counter = Counter(
            "sits:fault_injected",
            "Faults injected by --fault-injection, by kind.",
            ["model_name", "kind"],
            registry=registry,
        )
        self._model_name = model_name
        for item in spec.items:  # exported at 0 from the start
            self._counter.labels(model_name, item.kind.value)

    def decide(self) -> FaultDecision:
        """The next request's decision (one draw per item, in spec order)."""
        fired = [item for item in self.spec.items if self._random.random() * 100 < item.percent]
        for item in fired:
            self._counter.labels(self._model_name, item.kind.value).inc()
        delay_s = sum(item.delay_s for item in fired if item.kind is FaultKind.DELAY)
        hang = any(item.kind is FaultKind.HANG for item in fired)
        aborts = [item.status for item in fired if item.kind is FaultKind.ABORT]
        return FaultDecision(delay_s, hang, None if hang or not aborts else aborts[0])


def fault_error(status: int) -> ServerError:
    """The injected error answer of `status`."""
    if status == 503:
        kind = "service_unavailable_error"
    else:
        kind = "server_error" if status >= 500 else "invalid_request_error"
    return ServerError(status, f"Fault injected (HTTP {status}).", type=kind, code=FAULT_CODE)


class FaultInjectionMiddleware:
    """ASGI middleware applying `injector`'s decisions to POSTs of FAULT_PATHS.

    Args:
        app: the wrapped ASGI app.
        injector: the decisions.
        drain_started: set when the server starts draining (ends the hangs).
        sleep: the delay's sleep (tests pass a recorder).
    """

    def __init__(
        self,
        app: ASGIApp,
        injector: FaultInjector,
        drain_started: asyncio.Event,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.app = app
        self.injector = injector
        self.drain_started = drain_started
        self.sleep = sleep

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in FAULT_PATHS
        ):
            await self.app(scope, receive, send)
            return
        decision = self.injector.decide()
        if decision.delay_s > 0:
            await self.sleep(decision.delay_s)
        if decision.hang:
            if await self._hang(receive):
                return  # the client went away: nothing to answer
            await error_response(draining_error())(scope, receive, send)
        elif decision.abort_status is not None:
            await error_response(fault_error(decision.abort_status))(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _hang(self, receive: Receive) -> bool:
        """Wait for the client's disconnect or the drain; True for the disconnect."""

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        drain = asyncio.ensure_future(self.drain_started.wait())
        try:
            done, _ = await asyncio.wait({gone, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (gone, drain):
                task.cancel()
        return gone in done
