"""Helpers of the tenant tests: tenants with known keys, engines with tenant policies, and a
live server's context."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sits.admission import OverloadThresholds
from sits.config import EngineConfig
from sits.server.context import ServerContext
from sits.tenancy import TenantConfig, TenantsConfig, hash_api_key
from tests.server.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.server.live import LiveServer, metric_samples

# Thresholds no test load reaches: for servers whose tests pin the overload state themselves
# (with a fake clock the monitor's hold time never passes, so a measured step up would stick).
NEVER_OVERLOADED = OverloadThresholds(
    yellow_queue_delay_s=1e9,
    red_queue_delay_s=1e9,
    yellow_kv_usage=1.0,
    red_kv_usage=1.0,
    yellow_ttft_ratio=1e18,
    red_ttft_ratio=1e18,
    backlog_shed_factor=math.inf,
)


def key_of(tenant_id: str) -> str:
    """The API key of a test tenant."""
    return f"key-{tenant_id}"


def tenant(tenant_id: str, **fields: Any) -> TenantConfig:
    """A tenant whose key is `key_of(tenant_id)`."""
    return TenantConfig(id=tenant_id, api_key_sha256=(hash_api_key(key_of(tenant_id)),), **fields)


def auth(tenant_id: str) -> dict[str, str]:
    """The Authorization header of a test tenant."""
    return {"Authorization": f"Bearer {key_of(tenant_id)}"}


def tenant_engine(model_dir: Path, tenants: TenantsConfig, **config: Any) -> Callable[[], Any]:
    """`make_engine` for LiveServer: an AsyncLLM on `model_dir` scheduling `tenants`."""

    def make_engine() -> Any:
        from sits.engine.async_llm import AsyncLLM
        from sits.engine.builder import tenant_policies_of

        kwargs: dict[str, Any] = {
            "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN,
            "kv_cache_memory_bytes": KV_CACHE_BYTES,
        }
        kwargs.update(config)
        return AsyncLLM(
            EngineConfig(model=str(model_dir), **kwargs),
            tenant_policies=tenant_policies_of(tenants),
        )

    return make_engine


def ctx_of(live: LiveServer) -> ServerContext:
    """The ServerContext of a live server's app."""
    assert live.server is not None
    return live.server.config.app.state.ctx


def scrape(live: LiveServer) -> Callable[..., float]:
    """Scrape /metrics once; returns `value(name, **labels)` (labels without model_name)."""
    with live.http() as http:
        samples = metric_samples(http.get("/metrics").text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    return value
