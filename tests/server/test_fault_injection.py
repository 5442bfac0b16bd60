"""Fault injection (`sits serve --fault-injection SPEC`): the spec grammar, seeded decisions
counted exactly, the middleware's delay / abort / hang, the CLI's refusal, and a live server."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from sits.cli.fleet_flags import fault_injection_arg
from sits.cli.serve import add_serve_parser, run_serve
from sits.core.errors import InvalidParameterError
from sits.server.context import ServerSettings
from sits.server.faults import (
    FaultDecision,
    FaultInjectionMiddleware,
    FaultInjector,
    FaultItem,
    FaultKind,
    FaultSpec,
    parse_fault_spec,
)
from tests.server.live import LiveServer
from tests.server.tenant_fixtures import ctx_of, scrape
from tests.waits import HANG_S

_WAIT_S = HANG_S


@pytest.mark.parametrize(
    ("text", "items"),
    [("delay=0.5@20", (FaultItem(FaultKind.DELAY, 20.0, delay_s=0.5),)),
     ("abort=503@5", (FaultItem(FaultKind.ABORT, 5.0, status=503),)),
     ("hang@1.5", (FaultItem(FaultKind.HANG, 1.5),)),
     (" hang@0 , abort=429@100,delay=0@100 ",
      (FaultItem(FaultKind.HANG, 0.0), FaultItem(FaultKind.ABORT, 100.0, status=429),
       FaultItem(FaultKind.DELAY, 100.0, delay_s=0.0)))],
)  # fmt: skip
def test_spec_grammar(text: str, items: tuple[FaultItem, ...]) -> None:
    spec = parse_fault_spec(text, seed=3)
    assert spec == FaultSpec(items, seed=3)
    assert parse_fault_spec(spec.describe(), seed=3) == spec


@pytest.mark.parametrize(
    ("text", "item"),
    [("", ""), ("delay", "delay"), ("delay@5", "delay@5"), ("delay=x@5", "delay=x@5"),
     ("delay=-1@5", "delay=-1@5"), ("delay=inf@5", "delay=inf@5"), ("delay=1@nan", "delay=1@nan"),
     ("abort=200@5", "abort=200@5"), ("abort=600@5", "abort=600@5"), ("abort=5x3@5", "abort=5x3@5"),
     ("abort=503@101", "abort=503@101"), ("abort=503@-1", "abort=503@-1"), ("hang=1@5", "hang=1@5"),
     ("hang@", "hang@"), ("@5", "@5"), ("explode=1@5", "explode=1@5"),
     ("hang@5,,abort=503@1", ""), ("delay=1@5,delay=2@5", "delay=2@5")],
)  # fmt: skip
def test_bad_specs_name_the_item(text: str, item: str) -> None:
    with pytest.raises(InvalidParameterError) as err:
        parse_fault_spec(text)
    assert err.value.param == "fault_injection"
    assert str(err.value).startswith(f"item {item!r}: ")


def _replay(spec: FaultSpec, n: int) -> list[FaultDecision]:
    """The documented rule, independently: one draw per item in order, fired when
    draw * 100 < percent; a hang wins over an abort."""
    rng = random.Random(spec.seed)
    out = []
    for _ in range(n):
        fired = {item.kind: item for item in spec.items if rng.random() * 100 < item.percent}
        delay = fired[FaultKind.DELAY].delay_s if FaultKind.DELAY in fired else 0.0
        hang = FaultKind.HANG in fired
        abort = fired[FaultKind.ABORT].status if FaultKind.ABORT in fired and not hang else None
        out.append(FaultDecision(delay, hang, abort))
    return out


def _counts(registry: CollectorRegistry) -> dict[str, float]:
    return {
        s.labels["kind"]: s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == "sits:fault_injected_total"
    }


def test_decisions_are_exact_for_a_seed_and_counted() -> None:
    spec = parse_fault_spec("delay=0.25@30,abort=500@20,hang@10", seed=7)
    registry = CollectorRegistry()
    injector = FaultInjector(spec, registry, "m")
    assert _counts(registry) == {"delay": 0, "abort": 0, "hang": 0}
    decisions = [injector.decide() for _ in range(1000)]
    assert decisions == _replay(spec, 1000)
    counts = _counts(registry)
    assert counts == {
        "delay": sum(d.delay_s > 0 for d in decisions),
        "abort": sum(1 for d in _raw_fires(spec, 1000) if FaultKind.ABORT in d),
        "hang": sum(d.hang for d in decisions),
    }
    assert 0 < counts["hang"] < counts["abort"] < counts["delay"] < 1000
    again = FaultInjector(spec, CollectorRegistry(), "m")
    assert [again.decide() for _ in range(1000)] == decisions
    other = FaultInjector(parse_fault_spec(spec.describe(), seed=8), CollectorRegistry(), "m")
    assert [other.decide() for _ in range(1000)] != decisions


def _raw_fires(spec: FaultSpec, n: int) -> list[set[FaultKind]]:
    rng = random.Random(spec.seed)
    return [
        {item.kind for item in spec.items if rng.random() * 100 < item.percent} for _ in range(n)
    ]


def _app(spec: FaultSpec, sleeps: list[float]) -> tuple[TestClient, CollectorRegistry]:
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/tokenize")
    async def served() -> dict[str, bool]:
        return {"served": True}

    @app.get("/v1/completions")
    async def got() -> dict[str, bool]:
        return {"served": True}

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    registry = CollectorRegistry()
    injector = FaultInjector(spec, registry, "m")
    app.add_middleware(
        FaultInjectionMiddleware, injector=injector, drain_started=asyncio.Event(), sleep=sleep
    )
    return TestClient(app), registry


def test_the_middleware_delays_and_aborts_only_generation_posts() -> None:
    spec = parse_fault_spec("delay=1.5@50,abort=503@30", seed=1)
    sleeps: list[float] = []
    client, registry = _app(spec, sleeps)
    expected = _replay(spec, 40)
    statuses = []
    for i in range(40):
        path = "/v1/completions" if i % 2 == 0 else "/v1/chat/completions"
        resp = client.post(path, json={})
        statuses.append(resp.status_code)
        if resp.status_code == 503:
            error = resp.json()["error"]
            assert error["code"] == "fault_injected"
            assert error["type"] == "service_unavailable_error"
        else:
            assert resp.json() == {"served": True}
        # Other routes and methods draw nothing.
        assert client.post("/tokenize", json={}).status_code == 200
        assert client.get("/v1/completions").status_code == 200
    assert statuses == [503 if d.abort_status else 200 for d in expected]
    assert sleeps == [1.5 for d in expected if d.delay_s]
    assert _counts(registry) == {
        "delay": len(sleeps),
        "abort": sum(d.abort_status is not None for d in expected),
    }


def test_a_4xx_abort_has_an_invalid_request_type() -> None:
    client, _ = _app(parse_fault_spec("abort=429@100"), [])
    resp = client.post("/v1/completions", json={})
    assert resp.status_code == 429
    assert resp.json()["error"] == {
        "message": "Fault injected (HTTP 429).",
        "type": "invalid_request_error",
        "param": None,
        "code": "fault_injected",
    }


class _Asgi:
    """One ASGI request against the middleware: the body, then a disconnect on demand."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.waiting = asyncio.Event()  # the middleware waits for the client's next message
        self.leave = asyncio.Event()
        self._calls = 0

    async def receive(self) -> dict[str, Any]:
        self._calls += 1
        if self._calls == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        self.waiting.set()
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


async def _hang(end_by_drain: bool) -> list[dict[str, Any]]:
    async def app(scope, receive, send) -> None:  # never reached
        raise AssertionError("a hung request was served")

    drain = asyncio.Event()
    middleware = FaultInjectionMiddleware(
        app, FaultInjector(parse_fault_spec("hang@100"), CollectorRegistry(), "m"), drain
    )
    client = _Asgi()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    task = asyncio.ensure_future(middleware(scope, client.receive, client.send))
    await asyncio.wait_for(client.waiting.wait(), _WAIT_S)
    assert client.sent == [] and not task.done()  # hanging: nothing answered
    if end_by_drain:
        drain.set()
    else:
        client.leave.set()
    await asyncio.wait_for(task, _WAIT_S)
    return client.sent


def test_a_hang_ends_silently_when_the_client_leaves() -> None:
    assert asyncio.run(_hang(end_by_drain=False)) == []


def test_a_hang_answers_503_draining_when_the_server_drains() -> None:
    sent = asyncio.run(_hang(end_by_drain=True))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"]["code"] == "draining"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_fault_flags() -> None:
    assert fault_injection_arg(_parse([])) is None
    assert fault_injection_arg(_parse(["--enable-fault-injection"])) is None
    args = _parse(["--fault-injection", "hang@5", "--enable-fault-injection", "--fault-seed", "9"])
    assert fault_injection_arg(args) == FaultSpec((FaultItem(FaultKind.HANG, 5.0),), seed=9)
    assert ServerSettings().fault_injection is None  # off by default


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--fault-injection", "abort=503@5"],
      "--fault-injection makes requests fail on purpose: add --enable-fault-injection"),
     (["--fault-injection", "abort=503@5,boom@1", "--enable-fault-injection"],
      "item 'boom@1': expected delay=SECONDS@PERCENT")],
)  # fmt: skip
def test_the_cli_refuses_faults_unless_enabled_and_well_formed(argv, message, capsys) -> None:
    assert run_serve(_parse(["--model", "/does/not/exist", *argv])) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_a_live_server_injects_exactly_the_seeded_faults(tiny_moe_dir, engine_factory) -> None:
    spec = parse_fault_spec("abort=500@40,hang@10", seed=4)
    expected = _replay(spec, 40)
    first_hang = next(i for i, d in enumerate(expected) if d.hang)
    assert first_hang >= 3
    settings = ServerSettings(fault_injection=spec)
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live, live.http() as http:
        body = {"prompt": "def fibonacci(n):", "max_tokens": 1}
        for decision in expected[:first_hang]:
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == (500 if decision.abort_status else 200), resp.text
            if decision.abort_status:
                assert resp.json()["error"]["code"] == "fault_injected"
        assert http.get("/health").status_code == 200  # not a generation route
        value = scrape(live)
        num_aborts = sum(d.abort_status is not None for d in expected[:first_hang])
        assert value("sits:fault_injected_total", kind="abort") == num_aborts
        assert value("sits:fault_injected_total", kind="hang") == 0
        hung: list[httpx.Response] = []
        thread = threading.Thread(
            target=lambda: hung.append(http.post("/v1/completions", json=body)), daemon=True
        )
        thread.start()
        assert live.wait_until(
            lambda: scrape(live)("sits:fault_injected_total", kind="hang") == 1, _WAIT_S
        )
        assert thread.is_alive()  # hanging
        assert live.loop is not None and live.server is not None
        live.loop.call_soon_threadsafe(live.server.start_drain)
        thread.join(_WAIT_S)
        assert hung[0].status_code == 503 and hung[0].json()["error"]["code"] == "draining"
        assert ctx_of(live).faults is not None
