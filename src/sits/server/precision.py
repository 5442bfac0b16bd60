"""The server's side of the runtime precision switch (`--precision-switch`, issue 25).

`PrecisionSwitcher` is the one place that asks the engine to switch its weight set:
- the operator (`POST /v1/admin/precision`, `switch`): the policy then resumes from the
  operator's choice (`OverloadPrecisionPolicy.restart`);
- with `--precision-policy overload`, a task that, every `poll_s`, hands the server's overload
  state to `OverloadPrecisionPolicy` and applies what it decides (`tick`).
Switches are serialised by one lock, so the policy never races the operator.
`PrecisionCollector` exports, read from `engine.precision_state()` at scrape time:
`sits:weight_precision{model_name,precision}` (1 for the current set, 0 for the other) and
`sits:precision_switches_total{model_name}`. Without a switch configured (the engine has no
`precision_state`, or holds one weight set) neither is exported.
The response header `x-sits-precision` (`PRECISION_HEADER`) is set by the serving code from
the outputs' `precision` (`GenerationJob.precision`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from sits.admission import Clock, OverloadState
from sits.admission.precision_policy import (
    OverloadPrecisionPolicy,
    PrecisionPolicyKind,
    PrecisionPolicySettings,
    split_precisions,
)
from sits.core.errors import InvalidParameterError
from sits.core.precision import PrecisionState

logger = logging.getLogger(__name__)

PRECISION_HEADER = "x-sits-precision"
NO_SWITCH = (
    "this server has no precision switch: start it with --precision-switch fp8 or "
    "--precision-switch int4"
)


def engine_precision(engine: Any) -> PrecisionState | None:
    """The engine's `PrecisionState`, or None without a switch (no `precision_state`, or one
    weight set only) or with a dead engine."""
    getter = getattr(engine, "precision_state", None)
    if getter is None:
        return None
    try:
        state = getter()
    except Exception:  # noqa: BLE001 - a dead engine: the lifecycle reports it
        return None
    return state if state is not None and len(state.available) > 1 else None


def precision_json(
    state: PrecisionState | None, settings: PrecisionPolicySettings
) -> dict[str, Any]:
    """The body of `GET /v1/admin/precision`: the engine's `PrecisionState` (None: no switch,
    `available` empty) and the policy (`--precision-policy`, red and green seconds)."""
    policy = {
        "name": settings.policy.value,
        "red_seconds": settings.red_s,
        "green_seconds": settings.green_s,
    }
    if state is None:
        return {
            "current": None,
            "available": [],
            "num_switches": 0,
            "last_switch_step": None,
            "last_switch_unix_s": None,
            "last_switch_delay_s": None,
            "policy": policy,
        }
    return {
        "current": state.current,
        "available": list(state.available),
        "num_switches": state.num_switches,
        "last_switch_step": state.last_switch_step,
        "last_switch_unix_s": state.last_switch_unix_s,
        "last_switch_delay_s": state.last_switch_delay_s,
        "policy": policy,
    }


class PrecisionSwitcher:
    """Operator and policy switches of the engine's weights (see the module docstring).

    Args:
        engine: the engine front end (`set_precision`, `precision_state`).
        settings: the precision policy.
        overload_state: the server's overload state now (`ServerQos.overload_state`).
        clock: the policy's time source (the QoS clock).
        poll_s: how often the `overload` policy looks at the state.

    Raises:
        InvalidParameterError: `overload` policy on an engine without a precision switch.
    """

    def __init__(
        self,
        engine: Any,
        settings: PrecisionPolicySettings,
        overload_state: Callable[[], OverloadState],
        clock: Clock,
        poll_s: float,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.overload_state = overload_state
        self.poll_s = poll_s
        self.policy: OverloadPrecisionPolicy | None = None
        if settings.policy is PrecisionPolicyKind.OVERLOAD:
            state = engine_precision(engine)
            if state is None:
                raise InvalidParameterError(
                    "precision_policy", f"--precision-policy overload: {NO_SWITCH}"
                )
            full, low = split_precisions(tuple(state.available))
            self.policy = OverloadPrecisionPolicy(settings, full, low, clock)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    def state(self) -> PrecisionState | None:
        """The engine's `PrecisionState`, or None without a switch."""
        return engine_precision(self.engine)

    async def switch(self, name: str) -> PrecisionState:
        """The operator's switch to `name`; returns the new `PrecisionState`.

        Raises:
            InvalidParameterError: no switch configured, or `name` is not one of the sets.
        """
        setter = getattr(self.engine, "set_precision", None)
        if setter is None or self.state() is None:
            raise InvalidParameterError("precision", NO_SWITCH)
        async with self._lock:
            before = self.state()
            state = await setter(name)
            if self.policy is not None:
                self.policy.restart()
        logger.info(
            "precision %s -> %s by the operator", getattr(before, "current", None), state.current
        )
        return state

    async def tick(self) -> PrecisionState | None:
        """One look of the `overload` policy; returns the new state after a switch, else None."""
        assert self.policy is not None, "only the overload policy ticks"
        async with self._lock:
            state = self.state()
            if state is None:
                return None
            overload = self.overload_state()
            target = self.policy.decide(overload, state.current)
            if target is None:
                return None
            new_state = await self.engine.set_precision(target)
        logger.warning(
            "precision %s -> %s: the overload state has been %s for %g s",
            state.current,
            new_state.current,
            overload.value,
            self.settings.red_s if overload is OverloadState.RED else self.settings.green_s,
        )
        return new_state

    def start(self) -> None:
        """Start the policy's task (only for `overload`; call from the running loop)."""
        if self.policy is not None and self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - keep deciding; never kill the server
                logger.exception("precision policy check failed")

    async def stop(self) -> None:
        """Stop the policy's task."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class PrecisionCollector(Collector):
    """The precision metrics at scrape time (see the module docstring)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = engine_precision(self.engine)
        if state is None:
            return
        current = GaugeMetricFamily(
            "sits:weight_precision",
            "The weight set the engine runs (1) and the other one it holds (0).",
            labels=["model_name", "precision"],
        )
        for name in state.available:
            current.add_metric([self.model_name, name], 1.0 if name == state.current else 0.0)
        yield current
        switches = CounterMetricFamily(
            "sits:precision_switches",
            "Switches of the engine's weight set (operator and policy).",
            labels=["model_name"],
        )
        switches.add_metric([self.model_name], float(state.num_switches))
        yield switches
