"""Fleet registration: a replica's heartbeats to `sits router` (`sits serve --register-with`).

`FleetRegistration` runs one task in the app's lifespan. Once the server listens
(`ServerLifecycle.listening`, set by `sits.server.uvicorn_server.DrainingServer`) it posts the
replica's `Heartbeat`
(`sits.core.fleet`: its URL, model, version label, capacity, context length and load) to
ROUTER + REGISTER_PATH until the router accepts one, then to ROUTER + HEARTBEAT_PATH every
`heartbeat_interval_s`, each with `Authorization: Bearer ROUTER_KEY`. When the drain starts
(SIGTERM: `ServerLifecycle.drain_started`) it posts ROUTER + DEREGISTER_PATH once, body
`{"url": URL}`, and beats no more; when the lifespan ends without a drain (engine death, a
programmatic stop) `stop()` deregisters the same way.

The load of a heartbeat: `engine.stats()` (running, waiting, KV usage), the QoS overload state,
the lifecycle's draining flag, and TTFT/TPOT p50/p99 over the requests of the server's timeline
ring that ended within `latency_window_s` (`sits.obs.timeline.latency_summary`, the same
figures as the dashboard); None without such requests.

Invariants:
- It never blocks or fails serving: every post has a time-out (`request_timeout_s`), every
  error is caught; a failure (transport error or a non-2xx answer) is logged at WARNING once per
  outage (the first failure after start or after a success), the router's return at INFO, and
  the next beat simply tries again.
- No beat is sent while the engine is unhealthy (the router then expires the replica).
- Deregister is posted at most once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from sits.core.errors import InvalidParameterError
from sits.core.fleet import (
    DEFAULT_VERSION_LABEL,
    DEREGISTER_PATH,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_PATH,
    REGISTER_PATH,
    Heartbeat,
    ReplicaLoad,
    normalize_url,
)
from sits.obs.timeline import TimelineBuffer, latency_summary
from sits.server.engine_client import EngineClient

if TYPE_CHECKING:  # the context builds the registration; its annotation only
    from sits.server.context import ServerLifecycle

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RegistrationSettings:
    """Where and how a replica registers (`--register-with`, `--advertise-url`, ...).

    Attributes:
        router_url: the router's base URL, e.g. "http://127.0.0.1:8000" (trailing "/" dropped).
        advertise_url: the base URL the router reaches this replica at (trailing "/" dropped);
            None = "http://ADVERTISE_HOST:PORT" with the port the server bound (`--port 0`).
        advertise_host: the host of that default URL (an IPv6 address gets its brackets).
        version_label: "stable", "canary" or another label (`--version-label`).
        heartbeat_interval_s: seconds between beats, > 0 (the router expects HEARTBEAT_INTERVAL_S).
        request_timeout_s: time-out of one post to the router, seconds, > 0.
        latency_window_s: the heartbeat's latency percentiles cover requests that ended within
            this many seconds, > 0.

    Raises:
        InvalidParameterError: a URL that is not http(s) with a host, an empty label or one
            with whitespace, a non-positive or non-finite number.
    """

    router_url: str
    advertise_url: str | None = None
    advertise_host: str = "127.0.0.1"
    version_label: str = DEFAULT_VERSION_LABEL
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    request_timeout_s: float = 1.0
    latency_window_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("router_url", "advertise_url"):
            url = getattr(self, name)
            if url is None and name == "advertise_url":
                continue
            parts = urlsplit(url) if isinstance(url, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidParameterError(name, f"must be an http(s) URL with a host: {url!r}")
            object.__setattr__(self, name, normalize_url(url))
        label = self.version_label
        if not isinstance(label, str) or not label or any(c.isspace() for c in label):
            raise InvalidParameterError(
                "version_label", f"must be a non-empty label without spaces, got {label!r}"
            )
        for name in ("heartbeat_interval_s", "request_timeout_s", "latency_window_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidParameterError(name, f"must be a number of seconds > 0, got {value}")


class FleetRegistration:
    """The heartbeat task of one replica (see the module docstring).

    Args:
        settings: where to register and how often.
        router_key: the router's bearer key.
        engine: read for its stats, max_model_len and `config.max_num_seqs` (capacity; 1
            for an engine without a config).
        lifecycle: its draining flag, `drain_started` event and `healthy()`.
        model_name: the served model's name.
        overload_state: returns the QoS overload state's value ("green", "yellow", "red").
        timelines: the server's ring of recent request timelines.
        transport: an httpx transport (tests); None = httpx's own.
        now: time.monotonic-like clock of the latency window (the timelines' clock).

    Attributes:
        registered: the router accepted a register or heartbeat post.
        deregistered: the deregister post was sent (whatever the answer).
        num_posts: posts sent per path (attempts, failed ones included).
        num_failures: failed posts (transport error or non-2xx answer).
    """

    def __init__(
        self,
        settings: RegistrationSettings,
        router_key: str,
        *,
        engine: EngineClient,
        lifecycle: ServerLifecycle,
        model_name: str,
        overload_state: Callable[[], str],
        timelines: TimelineBuffer,
        transport: httpx.AsyncBaseTransport | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._router_key = router_key
        self._engine = engine
        self._lifecycle = lifecycle
        self._model_name = model_name
        self._overload_state = overload_state
        self._timelines = timelines
        self._transport = transport
        self._now = now
        config = getattr(engine, "config", None)
        self.capacity = max(int(getattr(config, "max_num_seqs", 1)), 1)
        self.registered = False
        self.deregistered = False
        self.num_posts: dict[str, int] = {REGISTER_PATH: 0, HEARTBEAT_PATH: 0, DEREGISTER_PATH: 0}
        self.num_failures = 0
        self._in_outage = False
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None

    # --- the message ------------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat:
        """This replica's heartbeat now (never raises for a failing engine: its load reads 0)."""
        try:
            stats: Any = self._engine.stats()
        except Exception:  # noqa: BLE001 - a dead engine: report no load, the probe sees it
            stats = None
        cutoff_s = self._now() - self.settings.latency_window_s
        recent = [t for t in self._timelines.recent() if t.finished_s >= cutoff_s]
        latency = latency_summary(recent)
        ttft, tpot = latency["ttft_s"], latency["tpot_s"]
        kv_usage = float(getattr(stats, "kv_cache_usage", 0.0))
        load = ReplicaLoad(
            num_running=int(getattr(stats, "num_running", 0)),
            num_waiting=int(getattr(stats, "num_waiting", 0)),
            kv_cache_usage=min(max(kv_usage, 0.0), 1.0) if math.isfinite(kv_usage) else 0.0,
            overload_state=self._overload_state(),
            ttft_p50_s=ttft.get("p50"),
            ttft_p99_s=ttft.get("p99"),
            tpot_p50_s=tpot.get("p50"),
            tpot_p99_s=tpot.get("p99"),
            draining=self._lifecycle.draining,
        )
        return Heartbeat(
            url=self.url or "",
            models=(self._model_name,),
            version_label=self.settings.version_label,
            capacity=self.capacity,
            max_model_len=int(self._engine.max_model_len),
            load=load,
        )

    # --- the task ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the heartbeat task (call from the running event loop); idempotent."""
        if self._task is not None:
            return
        self._client = httpx.AsyncClient(
            base_url=self.settings.router_url,
            headers={"Authorization": f"Bearer {self._router_key}"},
            timeout=self.settings.request_timeout_s,
            transport=self._transport,
        )
        logger.info(
            "registering with the fleet router %s as %s (%s)",
            self.settings.router_url,
            self.settings.advertise_url,
            self.settings.version_label,
        )
        self._task = asyncio.create_task(self._run(), name="sits-fleet-heartbeat")

    async def stop(self) -> None:
        """Stop beating, deregister if not done yet, close the client; bounded by about two
        post time-outs. Idempotent."""
        task, self._task = self._task, None
        if task is None:
            return
        if self._lifecycle.drain_started.is_set() and not task.done():
            # The task is deregistering (or about to): let that post finish.
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, self.settings.request_timeout_s * 2)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._deregister()
        assert self._client is not None
        await self._client.aclose()

    @property
    def url(self) -> str | None:
        """The advertised URL (None while the bound port of a default URL is not known)."""
        if self.settings.advertise_url is not None:
            return self.settings.advertise_url
        port = self._lifecycle.bound_port
        if port is None:
            return None
        host = self.settings.advertise_host
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    async def _run(self) -> None:
        drain = self._lifecycle.drain_started
        if not await _first_of(self._lifecycle.listening, drain):
            return  # drained before it ever listened: nothing to register
        path = REGISTER_PATH
        while not drain.is_set():
            if self._lifecycle.healthy() and await self._post(path, self._message()):
                path = HEARTBEAT_PATH
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(drain.wait(), self.settings.heartbeat_interval_s)
        await self._deregister()

    def _message(self) -> dict[str, Any] | None:
        try:
            return self.heartbeat().to_json()
        except Exception:  # noqa: BLE001 - never fatal: report and try on the next beat
            logger.exception("could not build the fleet heartbeat")
            return None

    async def _deregister(self) -> None:
        if self.deregistered or not any(self.num_posts.values()):
            return  # done already, or the router never heard of this replica
        self.deregistered = True
        if await self._post(DEREGISTER_PATH, {"url": self.url}):
            logger.info("deregistered from the fleet router %s", self.settings.router_url)

    async def _post(self, path: str, body: dict[str, Any] | None) -> bool:
        """POST `body` to the router's `path`; True for a 2xx answer. Never raises."""
        if body is None:
            return False
        assert self._client is not None
        self.num_posts[path] += 1
        try:
            resp = await self._client.post(path, json=body)
        except (httpx.HTTPError, OSError) as exc:
            self._failed(path, f"{type(exc).__name__}: {exc}")
            return False
        if not resp.is_success:
            self._failed(path, f"HTTP {resp.status_code}: {resp.text[:200]}")
            return False
        if path != DEREGISTER_PATH:
            self.registered = True
        if self._in_outage:
            self._in_outage = False
            logger.info("the fleet router %s answers again", self.settings.router_url)
        return True

    def _failed(self, path: str, reason: str) -> None:
        self.num_failures += 1
        if not self._in_outage:
            self._in_outage = True
            logger.warning(
                "fleet router %s%s failed (%s); retrying every %.1f s",
                self.settings.router_url,
                path,
                reason,
                self.settings.heartbeat_interval_s,
            )


async def _first_of(wanted: asyncio.Event, other: asyncio.Event) -> bool:
    """Wait until `wanted` or `other` is set; True when `wanted` is."""
    if not (wanted.is_set() or other.is_set()):
        waits = [asyncio.ensure_future(event.wait()) for event in (wanted, other)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
    return wanted.is_set()
