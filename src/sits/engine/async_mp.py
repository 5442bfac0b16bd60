"""`AsyncMPLLM`: `AsyncLLM` with the engine loop in a child process (`--engine-process`).

The same front end over the process transport (`sits.engine.process_transport`); kept as a
name for the CLI, the benchmarks and the tests that pick the engine's mode by class.
"""

from __future__ import annotations

from typing import Any

from sits.config import EngineConfig
from sits.engine.async_llm import AsyncLLM


class AsyncMPLLM(AsyncLLM):
    """`AsyncLLM(config, engine_process=True, **kwargs)` (same arguments and errors)."""

    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        super().__init__(config, engine_process=True, **kwargs)
