"""A disconnect storm on a live `sits serve`: streams opened at once and dropped after their
first chunk. After, /metrics shows no KV block in use and nothing running or waiting, /health
answers 200 and a new request completes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.conftest import PROMPT, size
from tests.server.live import metric_samples
from tests.waits import HANG_S

pytestmark = pytest.mark.reliability

_ABORTED = ("sits:request_success_total", (("finished_reason", "abort"),))


async def _open_and_drop(http: httpx.AsyncClient, body: dict) -> str:
    """'dropped' once a first chunk came and the stream was cut; else what went wrong."""
    try:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"status {resp.status_code}"
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return "dropped"  # leaving the block closes the connection mid-stream
    except httpx.TransportError as exc:
        return f"transport error {exc!r}"
    return "no chunk"


def test_a_disconnect_storm_frees_every_block(shared_server, figures) -> None:
    server = shared_server
    count = size("storm_streams")
    assert server.wait_until_idle()
    with server.http() as http:
        aborted_before = metric_samples(http.get("/metrics").text).get(_ABORTED, 0.0)
    body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}

    async def storm() -> list[str]:
        limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=HANG_S, limits=limits
        ) as http:
            return await asyncio.gather(*(_open_and_drop(http, body) for _ in range(count)))

    outcomes = asyncio.run(storm())
    figures.update(
        requests=count,
        lost=sum(o != "dropped" for o in outcomes),
        **{"5xx": sum(o.startswith("status 5") for o in outcomes)},
    )
    assert outcomes == ["dropped"] * count
    assert server.wait_until_idle()  # every KV block free, nothing running or waiting
    assert server.health().status_code == 200
    with server.http() as http:
        aborted = metric_samples(http.get("/metrics").text)[_ABORTED] - aborted_before
    assert aborted == count
    server.complete(max_tokens=8)
    assert server.wait_until_idle()
