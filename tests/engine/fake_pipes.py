"""A stand-in for the engine loop's command source (`sits.engine.engine_loop.CommandSource`):
`poll` and `recv` over a list of commands, for tests of `EngineLoop`."""

from __future__ import annotations

from typing import Any


class Inbox:
    """A command source over `commands` (received front first)."""

    def __init__(self, commands: list[Any]) -> None:
        self.commands = commands

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.commands)

    def recv(self) -> Any:
        return self.commands.pop(0)
