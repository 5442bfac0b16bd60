"""Fixtures of the server tests: engines on tiny random checkpoints and live servers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sits.config import EngineConfig

# 16 MiB of KV cache: 2048 blocks of 16 tokens for the tiny models (fast to allocate).
KV_CACHE_BYTES = 16 << 20
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The tiny random Qwen3-MoE checkpoint (no BOS, ChatML template) shared by the tests."""
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="session")
def engine_factory() -> Callable[..., Callable[[], Any]]:
    """`factory(model_dir, health_timeout_s=10, step_timeout_s=60, **config) -> make_engine`
    for LiveServer."""

    def factory(
        model_dir: Path,
        health_timeout_s: float = 10.0,
        step_timeout_s: float = 60.0,
        **config: Any,
    ) -> Callable[[], Any]:
        def make_engine() -> Any:
            from sits.engine.async_llm import AsyncLLM

            kwargs: dict[str, Any] = {
                "dtype": "float32",
                "max_model_len": MAX_MODEL_LEN,
                "kv_cache_memory_bytes": KV_CACHE_BYTES,
            }
            kwargs.update(config)
            return AsyncLLM(
                EngineConfig(model=str(model_dir), **kwargs),
                health_timeout_s=health_timeout_s,
                step_timeout_s=step_timeout_s,
            )

        return make_engine

    return factory


@pytest.fixture(scope="session")
def server(tiny_moe_dir: Path, engine_factory: Callable[..., Callable[[], Any]]):
    """The main live server (tiny MoE, no API key), shared by the API and case tests."""
    from tests.server.live import LiveServer

    with LiveServer(engine_factory(tiny_moe_dir)) as live:
        yield live


@pytest.fixture(scope="session")
def client(server):
    """The official OpenAI client on the main server."""
    return server.client()


@pytest.fixture(scope="session")
def model_name(client) -> str:
    """The served model's name."""
    return client.models.list().data[0].id
