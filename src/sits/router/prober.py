"""The router's background round: active health probes, heartbeat expiry, model discovery and
the canary's timer.

Every `probe_interval_s` the round (1) takes out registered replicas whose heartbeats stopped
(`Registry.expire`), (2) sends `GET /health` to every replica at once (a failed or slow probe
takes it out, `Registry.record_probe`), (3) asks a static replica that has not said its models
for `/v1/models`, and (4) lets the canary controller evaluate even when no request ends (a canary
without traffic still steps or rolls back on what its window holds). The round never raises:
a failing probe is a fact about a replica, not about the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from sits.router.canary import CanaryController, log_canary
from sits.router.registry import Registry, Replica, ReplicaStatus

logger = logging.getLogger(__name__)


class Prober:
    """The background round (see the module docstring).

    Args:
        registry: the replicas.
        canary: the canary controller.
        session: the pooled HTTP client session.
        interval_s: seconds between rounds.
        timeout_s: seconds one probe may take.
        router_key: bearer key for a static replica's `/v1/models` (None: none sent).
        canary_present: returns whether a healthy canary replica is registered.
    """

    def __init__(
        self,
        registry: Registry,
        canary: CanaryController,
        session: aiohttp.ClientSession,
        *,
        interval_s: float,
        timeout_s: float,
        router_key: str | None,
        canary_present: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self.canary = canary
        self.session = session
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.router_key = router_key
        self.canary_present = canary_present
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the rounds on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop the rounds (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.round()
            except Exception:  # noqa: BLE001 - keep probing whatever one round hit
                logger.exception("router probe round failed")
            await asyncio.sleep(self.interval_s)

    async def round(self) -> None:
        """One round: expiry, probes, model discovery, canary timer."""
        for url in self.registry.expire():
            logger.warning("replica %s missed its heartbeats: out of rotation", url)
        replicas = self.registry.all()
        await asyncio.gather(*(self._probe(r) for r in replicas))
        decision = self.canary.evaluate(self.canary_present())
        if decision is not None:
            log_canary(decision)

    async def _probe(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.get(replica.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        was = replica.status
        self.registry.record_probe(replica.url, ok)
        if replica.status is not was:
            level = logging.INFO if replica.status is ReplicaStatus.HEALTHY else logging.WARNING
            logger.log(level, "replica %s: %s -> %s", replica.url, was.value, replica.status.value)
        if ok and replica.static and not replica.models:
            await self._discover_models(replica)

    async def _discover_models(self, replica: Replica) -> None:
        headers = {"authorization": f"Bearer {self.router_key}"} if self.router_key else {}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.get(
                replica.url + "/v1/models", headers=headers, timeout=timeout
            ) as response:
                body = await response.json() if response.status == 200 else {}
            cards = body.get("data", [])
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return
        models = tuple(
            c["id"] for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)
        )
        if models:
            max_len = max((int(c.get("max_model_len") or 0) for c in cards), default=0)
            self.registry.set_models(replica.url, models, max_len)
