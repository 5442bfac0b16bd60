"""A real tiny engine with a simulated precision switch, for the server half's tests.

`SwitchingEngine` wraps an `AsyncLLM` (built without `precision_switch`) and simulates the
engine half's API (`set_precision`, `precision_state`, and `precision` /
`num_precision_switches` on every output) without switching any weights: the server's routes,
header, metrics and audit are tested against it with exact, paced switches.
Each output is stamped with the precision current when the wrapper hands it on, and the switch
count since the request's first output, so a test that switches between two outputs knows
exactly what the server must report. `delay_s` paces the outputs so a test can switch mid-request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from sits.core.errors import InvalidParameterError
from sits.core.outputs import RequestOutput
from sits.core.precision import PrecisionState


class SwitchingEngine:
    """`inner` (an AsyncLLM) plus a simulated switch between `available` (see the module).

    Attributes:
        enabled: False makes it an engine without a switch (one weight set, as `AsyncLLM`
            without `precision_switch`).
        delay_s: seconds slept before handing on each output.
    """

    def __init__(self, inner: Any, available: tuple[str, ...] = ("fp32", "int4")) -> None:
        self._inner = inner
        self.state = PrecisionState(available[0], available)
        self.enabled = True
        self.delay_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def precision_state(self) -> PrecisionState:
        return self.state if self.enabled else PrecisionState("fp32", ("fp32",))

    async def set_precision(self, name: str) -> PrecisionState:
        if not self.enabled or name not in self.state.available:
            raise InvalidParameterError("precision", f"unknown precision {name!r}")
        if name != self.state.current:
            self.state = dataclasses.replace(
                self.state,
                current=name,
                num_switches=self.state.num_switches + 1,
                last_switch_step=self.state.num_switches + 1,
                last_switch_unix_s=1.0e9,
                last_switch_delay_s=0.001,
            )
        return self.state

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        gen = self._inner.generate(*args, **kwargs)
        switches_at_start: int | None = None
        try:
            async for output in gen:
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if switches_at_start is None:
                    switches_at_start = self.state.num_switches
                yield dataclasses.replace(
                    output,
                    precision=self.state.current if self.enabled else None,
                    num_precision_switches=self.state.num_switches - switches_at_start,
                )
        finally:
            await gen.aclose()
