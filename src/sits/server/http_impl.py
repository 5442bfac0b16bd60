"""The HTTP process's protocol and event loop: uvicorn's `--http` and `--loop` choices.

"auto" takes httptools and uvloop when they are installed (`pip install httptools uvloop`, as
uvicorn[standard] does; sits does not require them), else h11 and asyncio's own loop. The HTTP
process parses every request and writes every streamed token as an SSE event, so its cost per
event bounds TTFT and ITL under load. Kept apart from `sits.server.uvicorn_server` (which imports
uvicorn) so the CLI can offer the choices without importing the server.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable

from sits.core.errors import InvalidParameterError

HTTP_CHOICES = ("auto", "h11", "httptools")
LOOP_CHOICES = ("auto", "asyncio", "uvloop")


def _installed(module: str) -> bool:
    """Is `module` importable (without importing it)?"""
    return importlib.util.find_spec(module) is not None


def resolve_http(http: str) -> str:
    """uvicorn's HTTP protocol for `http` (one of HTTP_CHOICES): "auto" is httptools when
    installed, else h11.

    Raises:
        InvalidParameterError: an unknown choice, or httptools asked for and not installed.
    """
    if http not in HTTP_CHOICES:
        raise InvalidParameterError("http", f"must be one of {', '.join(HTTP_CHOICES)}")
    if http == "auto":
        return "httptools" if _installed("httptools") else "h11"
    if http == "httptools" and not _installed("httptools"):
        raise InvalidParameterError("http", "httptools is not installed (pip install httptools)")
    return http


def loop_factory(loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory for `loop` (one of LOOP_CHOICES): uvloop's, or None for
    asyncio's default loop; "auto" is uvloop when installed.

    Raises:
        InvalidParameterError: an unknown choice, or uvloop asked for and not installed.
    """
    if loop not in LOOP_CHOICES:
        raise InvalidParameterError("loop", f"must be one of {', '.join(LOOP_CHOICES)}")
    if loop == "asyncio" or (loop == "auto" and not _installed("uvloop")):
        return None
    if not _installed("uvloop"):
        raise InvalidParameterError("loop", "uvloop is not installed (pip install uvloop)")
    import uvloop

    return uvloop.new_event_loop
