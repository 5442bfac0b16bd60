"""`sits.server.http_impl`: `sits serve --http/--loop`, uvicorn's choices resolved."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

from sits.core.errors import InvalidParameterError
from sits.server import http_impl
from sits.server.http_impl import loop_factory, resolve_http


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_auto_takes_httptools_and_uvloop_exactly_when_installed() -> None:
    assert resolve_http("auto") == ("httptools" if _installed("httptools") else "h11")
    factory = loop_factory("auto")
    assert (factory is not None) == _installed("uvloop")
    if factory is not None:
        loop = factory()
        try:
            assert type(loop).__module__.startswith("uvloop")
        finally:
            loop.close()


def test_explicit_choices_are_kept() -> None:
    assert resolve_http("h11") == "h11"
    assert loop_factory("asyncio") is None
    with asyncio.Runner(loop_factory=loop_factory("asyncio")) as runner:
        assert runner.run(asyncio.sleep(0, result=7)) == 7


def test_a_missing_implementation_is_a_named_error(monkeypatch) -> None:
    monkeypatch.setattr(http_impl, "_installed", lambda module: False)
    assert resolve_http("auto") == "h11" and loop_factory("auto") is None
    with pytest.raises(InvalidParameterError, match="httptools is not installed") as err:
        resolve_http("httptools")
    assert err.value.param == "http"
    with pytest.raises(InvalidParameterError, match="uvloop is not installed") as err:
        loop_factory("uvloop")
    assert err.value.param == "loop"


def test_unknown_choices_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match="must be one of auto, h11, httptools"):
        resolve_http("h2")
    with pytest.raises(InvalidParameterError, match="must be one of auto, asyncio, uvloop"):
        loop_factory("trio")


def test_successful_health_probes_leave_no_access_line() -> None:
    import logging

    from sits.server.uvicorn_server import QuietProbes

    def record(path: str, status: int) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "GET", path, "1.1", status)
        return logging.LogRecord("uvicorn.access", 20, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    quiet = QuietProbes()
    assert quiet.filter(record("/health", 200)) is False
    assert quiet.filter(record("/health", 503)) is True  # a failing probe is news
    assert quiet.filter(record("/v1/completions", 200)) is True
