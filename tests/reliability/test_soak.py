"""A soak of a live `sits serve`: mixed load (streamed and plain completions, chat, streams cut
early, tokenize, bad requests) from a few clients for `soak_s` seconds. No request lost, no 5xx,
the server's RSS grows less than `RSS_GROWTH_BOUND_KIB` after the warm-up, and after the load no
KV block is in use and nothing runs or waits."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.reliability.conftest import PROMPT, Serve, size
from tests.waits import HANG_S

pytestmark = pytest.mark.reliability

CLIENTS = 4
WARM_UP_FRACTION = 0.25  # of the soak, before the first RSS sample
# 64 MiB: the allocator's and caches' noise after a warm-up stays well under it; a leak of a
# request's state (its KV tables, token lists, a stream's buffers) at these rates exceeds it.
RSS_GROWTH_BOUND_KIB = 64 << 10


def _one(http: httpx.Client, kind: int) -> str:
    """One request of the mix; 'ok' when it got what it must, else what went wrong."""
    if kind == 0:
        body = {"prompt": PROMPT, "max_tokens": 16, "ignore_eos": True}
        resp = http.post("/v1/completions", json=body)
        ok = resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 16
    elif kind == 1:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        resp = http.post("/v1/chat/completions", json=body)
        ok = resp.status_code == 200 and resp.json()["choices"][0]["message"] is not None
    elif kind == 2:
        body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        ok = resp.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) == 25
    elif kind == 3:
        body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            ok = resp.status_code == 200 and any(
                line.startswith("data: ") for line in resp.iter_lines()
            )  # the first chunk, then the stream is cut
    elif kind == 4:
        resp = http.post("/tokenize", json={"prompt": PROMPT})
        ok = resp.status_code == 200 and resp.json()["count"] > 0
    else:
        resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": -1})
        ok = resp.status_code == 400
    if resp.status_code >= 500:
        return "5xx"
    return "ok" if ok else f"wrong {resp.status_code}"


def _client(server: Serve, stop: threading.Event, start: int, outcomes: Counter) -> None:
    with server.http() as http:
        for kind in itertools.count(start):
            if stop.is_set():
                return
            try:
                outcomes[_one(http, kind % 6)] += 1
            except httpx.TransportError:
                outcomes["lost"] += 1


def test_a_soak_leaks_no_memory_and_no_kv_block(shared_server, figures) -> None:
    server = shared_server
    soak_s = size("soak_s")
    outcomes: Counter = Counter()
    stop = threading.Event()
    clients = [
        threading.Thread(target=_client, args=(server, stop, i, outcomes), daemon=True)
        for i in range(CLIENTS)
    ]
    for client in clients:
        client.start()
    time.sleep(soak_s * WARM_UP_FRACTION)  # the load's length, not a wait for a state
    rss_start = server.rss_kib()
    time.sleep(soak_s * (1 - WARM_UP_FRACTION))
    stop.set()
    for client in clients:
        client.join(HANG_S)
    assert server.wait_until_idle()
    rss_end = server.rss_kib()
    figures.update(
        requests=sum(outcomes.values()),
        lost=outcomes["lost"],
        **{"5xx": outcomes["5xx"]},
        rss_start_kib=rss_start,
        rss_growth_kib=rss_end - rss_start,
    )
    assert set(outcomes) == {"ok"}, outcomes
    assert rss_end - rss_start < RSS_GROWTH_BOUND_KIB
    assert server.health().status_code == 200
