"""A stand-in for the engine process's end of its command pipe (`multiprocessing` Connection):
`poll` and `recv` over a list of commands, for tests of `sits.engine.engine_proc`."""

from __future__ import annotations


class Inbox:
    """The child's end of the command pipe over `commands` (received front first)."""

    def __init__(self, commands: list[tuple]) -> None:
        self.commands = commands

    def poll(self, timeout: float = 0.0) -> bool:
        return bool(self.commands)

    def recv(self) -> tuple:
        return self.commands.pop(0)
