"""Client disconnects abort their requests and free KV blocks at once (C14, disconnect storm)."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.live import LiveServer, metric_samples

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def long_context_dir(tiny_model_factory):
    """Tiny MoE with an 8192-token context, so max_tokens 4096 fits (C14)."""
    return tiny_model_factory("qwen3_moe", max_position_embeddings=8192)


def _read_first_chunk_then_disconnect(base_url: str, body: dict) -> dict:
    with (
        httpx.Client(base_url=base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[len("data: ") :])
    raise AssertionError("no chunk")


def _idle_and_all_blocks_free(live: LiveServer, num_total_blocks: int) -> bool:
    stats = live.engine.stats()
    return (
        stats.num_running == 0
        and stats.num_waiting == 0
        and stats.num_free_blocks == num_total_blocks
    )


def test_c14_client_disconnect_frees_blocks(long_context_dir, engine_factory) -> None:
    make_engine = engine_factory(long_context_dir, max_num_seqs=2, max_model_len=8192)
    with LiveServer(make_engine) as live:
        start = live.engine.stats()
        assert start.num_free_blocks == start.num_total_blocks
        body = {
            "prompt": PROMPT,
            "max_tokens": 4096,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        with ThreadPoolExecutor(2) as pool:
            firsts = list(
                pool.map(lambda _: _read_first_chunk_then_disconnect(live.base_url, body), range(2))
            )
        assert all(f["choices"] for f in firsts)
        # Both aborted: nothing running or waiting, every block free again.
        assert live.wait_until(lambda: _idle_and_all_blocks_free(live, start.num_total_blocks))
        with live.http() as http:
            short = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
            assert short.status_code == 200
            assert short.json()["usage"]["completion_tokens"] <= 3
            samples = metric_samples(http.get("/metrics").text)
        assert samples[("sits:request_success_total", (("finished_reason", "abort"),))] == 2
        # A non-streamed request whose client gives up is aborted too.
        with live.http(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={**body, "stream": False})
        assert live.wait_until(lambda: _idle_and_all_blocks_free(live, start.num_total_blocks))
        with live.http() as http:
            samples = metric_samples(http.get("/metrics").text)
        assert samples[("sits:request_success_total", (("finished_reason", "abort"),))] == 3


def test_disconnect_storm(tiny_moe_dir, engine_factory) -> None:
    """50 streams cut after their first chunk: running 0 and all blocks free within 2 s."""
    with LiveServer(engine_factory(tiny_moe_dir, max_num_seqs=64)) as live:
        start = live.engine.stats()
        body = {
            "prompt": PROMPT,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "temperature": 1.0,
        }

        async def one(http: httpx.AsyncClient) -> None:
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        return  # leaving the block closes the connection mid-stream

        async def storm() -> None:
            limits = httpx.Limits(max_connections=60, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=live.base_url, timeout=60, limits=limits) as http:
                await asyncio.gather(*(one(http) for _ in range(50)))

        asyncio.run(storm())
        assert live.wait_until(lambda: _idle_and_all_blocks_free(live, start.num_total_blocks))
        with live.http() as http:
            samples = metric_samples(http.get("/metrics").text)
            assert http.get("/health").status_code == 200
        assert samples[("sits:request_success_total", (("finished_reason", "abort"),))] == 50
