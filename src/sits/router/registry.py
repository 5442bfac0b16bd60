"""The router's registry of replicas: who they are, their load, and whether they take traffic.

Replicas come from `--replica`/`--fallback`/`--canary` flags (static: no heartbeats expected)
and from registration (`sits serve --register-with`: a `Heartbeat` every
`HEARTBEAT_INTERVAL_S`). Each has a status and its own circuit breaker.

Status rules (every time from the injected clock, in seconds):
- a heartbeat registers or refreshes a replica; it brings a DOWN or DRAINING replica back to
  HEALTHY, or makes it DRAINING when `load.draining` is set; a DOWN replica that beats again is
  a restarted process, so it comes back with a new (closed) breaker;
- a registered replica whose last heartbeat is `missed_heartbeats * heartbeat_interval_s`
  seconds old or more becomes DOWN (`expire`, also run by `candidates`, `models`, `counts`);
- a failed probe makes any replica DOWN; an ok probe brings back a DOWN or DRAINING *static*
  replica (its `/health` answers 200 only when it serves and does not drain), and a DOWN
  registered one only while its heartbeat is fresh (DRAINING registered ones wait for a
  heartbeat saying they no longer drain);
- `mark_draining` (the proxy saw a 503 "draining") takes a replica out of rotation at once;
- `deregister` forgets a registered replica; a static one stays known, DOWN, until a probe
  brings it back.
A replica is a routing candidate when HEALTHY, serving the model, and its breaker is not OPEN
(`candidates` reads `breaker.state`, so listing replicas never uses up a half-open probe; the
proxy calls `breaker.allow()` on the one replica it picked). Not thread-safe: the router uses it
from one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from sits.admission import BreakerConfig, BreakerState, CircuitBreaker, Clock
from sits.core.errors import InvalidParameterError
from sits.core.fleet import (
    CANARY_VERSION_LABEL,
    DEFAULT_VERSION_LABEL,
    HEARTBEAT_INTERVAL_S,
    MISSED_HEARTBEATS,
    Heartbeat,
    ReplicaLoad,
    normalize_url,
)
from sits.router.predictor import LatencyWindow

PRIMARY_POOL = "primary"
FALLBACK_POOL = "fallback"
POOLS = (PRIMARY_POOL, FALLBACK_POOL)


class ReplicaStatus(StrEnum):
    """Whether a replica takes new requests."""

    HEALTHY = "healthy"
    DOWN = "down"  # missed heartbeats or a failed probe
    DRAINING = "draining"  # shutting down: no new requests


@dataclass(slots=True)
class Replica:
    """One replica as the router knows it (mutable: the registry and the proxy update it).

    Attributes:
        url: its base URL, normalized (`normalize_url`): the registry's key.
        models: the model names it serves (a static replica's stay () until `set_models`).
        version_label: "stable", "canary" or another label.
        capacity: the most requests it runs at once, >= 1.
        max_model_len: its context length, tokens (0 = unknown).
        load: its load from the last heartbeat (all zeros for a static replica).
        static: from a flag; no heartbeats expected, never expired.
        pool: "primary" or "fallback".
        status: HEALTHY, DOWN or DRAINING (rules in the module docstring).
        last_heartbeat_s: clock time of its last heartbeat, seconds; None if it never sent one.
        probe_ok: the last active `/health` probe's result (True before the first probe).
        breaker: its circuit breaker (the registry's `BreakerConfig` and clock).
        inflight: requests the router sent it that have not finished (the proxy counts them).
        observed_ttft: TTFTs the router measured on it, seconds (for `predict_ttft_p99_s`).
    """

    url: str
    models: tuple[str, ...]
    version_label: str
    capacity: int
    max_model_len: int
    load: ReplicaLoad
    static: bool
    pool: str
    status: ReplicaStatus
    last_heartbeat_s: float | None
    probe_ok: bool
    breaker: CircuitBreaker
    observed_ttft: LatencyWindow
    inflight: int = 0

    @property
    def is_canary(self) -> bool:
        """Its version label is `CANARY_VERSION_LABEL`."""
        return self.version_label == CANARY_VERSION_LABEL

    def serves(self, model: str | None) -> bool:
        """It serves `model` (None: any model; a replica whose models are not known yet, a
        static one before its `/v1/models` was read, is tried for any model)."""
        return model is None or not self.models or model in self.models


class Registry:
    """The replicas the router knows (rules in the module docstring).

    Args:
        clock: time source (`monotonic()` seconds).
        breaker_config: each replica's breaker limits (default `BreakerConfig()`: open at > 30 %
            failed over 60 s with >= 10 requests, or 5 failures in a row; half-open after 30 s).
        heartbeat_interval_s: the replicas' heartbeat period, seconds, > 0.
        missed_heartbeats: a registered replica is DOWN after this many periods without a
            heartbeat, >= 1.
        ttft_window_s: the window of each replica's `observed_ttft`, seconds, > 0.

    Raises:
        InvalidParameterError: a value out of range.
    """

    def __init__(
        self,
        clock: Clock,
        breaker_config: BreakerConfig | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        missed_heartbeats: int = MISSED_HEARTBEATS,
        ttft_window_s: float = 60.0,
    ) -> None:
        if not heartbeat_interval_s > 0:
            raise InvalidParameterError(
                "heartbeat_interval_s", f"must be > 0: {heartbeat_interval_s}"
            )
        if missed_heartbeats < 1:
            raise InvalidParameterError("missed_heartbeats", f"must be >= 1: {missed_heartbeats}")
        if not ttft_window_s > 0:
            raise InvalidParameterError("ttft_window_s", f"must be > 0: {ttft_window_s}")
        self._clock = clock
        self.breaker_config = breaker_config or BreakerConfig()
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.missed_heartbeats = int(missed_heartbeats)
        self.ttft_window_s = float(ttft_window_s)
        self._replicas: dict[str, Replica] = {}

    @property
    def heartbeat_timeout_s(self) -> float:
        """Age of the last heartbeat, seconds, at which a registered replica becomes DOWN."""
        return self.missed_heartbeats * self.heartbeat_interval_s

    def add_static(
        self,
        url: str,
        pool: str = PRIMARY_POOL,
        models: Iterable[str] = (),
        version_label: str = DEFAULT_VERSION_LABEL,
    ) -> Replica:
        """Add a replica named by a flag; HEALTHY until a probe fails.

        Its pool and version label stay as given here, whatever heartbeats it may also send.

        Raises:
            InvalidParameterError: `url` is not http(s), the pool is unknown, the label is
                empty, or the url is already known.
        """
        _check_pool(pool)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidParameterError("url", f"must be an http(s) URL, got {url!r}")
        if not version_label:
            raise InvalidParameterError("version_label", "must be a non-empty string")
        key = normalize_url(url)
        if key in self._replicas:
            raise InvalidParameterError("url", f"replica {key} is given twice")
        replica = self._new(key, tuple(models), version_label, 1, static=True)
        replica.pool = pool
        self._replicas[key] = replica
        return replica

    def set_models(self, url: str, models: Iterable[str], max_model_len: int = 0) -> bool:
        """Set a replica's models and context length (a static replica's, from /v1/models).

        Returns:
            False when the url is unknown.
        """
        replica = self.get(url)
        if replica is None:
            return False
        replica.models = tuple(models)
        replica.max_model_len = int(max_model_len)
        return True

    def heartbeat(self, hb: Heartbeat, pool: str = PRIMARY_POOL) -> Replica:
        """Register a replica or refresh it from its heartbeat.

        Args:
            hb: the message.
            pool: the pool of a replica seen for the first time; a known replica keeps its own.

        Returns:
            The replica, HEALTHY, or DRAINING when `hb.load.draining`.

        Raises:
            InvalidParameterError: the pool is unknown.
        """
        _check_pool(pool)
        key = normalize_url(hb.url)
        replica = self._replicas.get(key)
        if replica is None:
            replica = self._new(key, hb.models, hb.version_label, hb.capacity, static=False)
            replica.max_model_len, replica.load, replica.pool = hb.max_model_len, hb.load, pool
            self._replicas[key] = replica
        else:
            replica.models = tuple(hb.models)
            replica.capacity = hb.capacity
            replica.max_model_len = hb.max_model_len
            replica.load = hb.load
            if not replica.static:
                replica.version_label = hb.version_label
        if replica.status is ReplicaStatus.DOWN:
            replica.breaker = CircuitBreaker(self.breaker_config, self._clock)
        replica.last_heartbeat_s = self._clock.monotonic()
        replica.status = ReplicaStatus.DRAINING if hb.load.draining else ReplicaStatus.HEALTHY
        return replica

    def deregister(self, url: str) -> bool:
        """A replica leaves (it drains): forget a registered one; a static one becomes DOWN.

        Returns:
            False when the url is unknown.
        """
        key = normalize_url(url)
        replica = self._replicas.get(key)
        if replica is None:
            return False
        if replica.static:
            replica.status = ReplicaStatus.DOWN
        else:
            del self._replicas[key]
        return True

    def mark_draining(self, url: str) -> bool:
        """Take a replica out of rotation at once (the proxy saw a 503 "draining"); a DOWN one
        stays DOWN.

        Returns:
            False when the url is unknown.
        """
        replica = self.get(url)
        if replica is None:
            return False
        if replica.status is ReplicaStatus.HEALTHY:
            replica.status = ReplicaStatus.DRAINING
        return True

    def record_probe(self, url: str, ok: bool) -> ReplicaStatus | None:
        """Apply an active `/health` probe's result (rules in the module docstring).

        Returns:
            The replica's status afterwards; None when the url is unknown.
        """
        replica = self.get(url)
        if replica is None:
            return None
        replica.probe_ok = ok
        if not ok:
            replica.status = ReplicaStatus.DOWN
        elif replica.static or (replica.status is ReplicaStatus.DOWN and self._fresh(replica)):
            replica.status = ReplicaStatus.HEALTHY
        return replica.status

    def expire(self) -> list[str]:
        """Make DOWN every registered replica whose last heartbeat is `heartbeat_timeout_s`
        seconds old or more.

        Returns:
            The urls that became DOWN now (they were HEALTHY or DRAINING), sorted.
        """
        out = []
        for replica in self.all():
            if (
                not replica.static
                and replica.status is not ReplicaStatus.DOWN
                and not self._fresh(replica)
            ):
                replica.status = ReplicaStatus.DOWN
                out.append(replica.url)
        return out

    def get(self, url: str) -> Replica | None:
        """The replica at `url` (normalized first), or None."""
        return self._replicas.get(normalize_url(url))

    def all(self) -> list[Replica]:
        """Every known replica, sorted by url."""
        return [self._replicas[key] for key in sorted(self._replicas)]

    def candidates(
        self, model: str | None, pool: str = PRIMARY_POOL, version_label: str | None = None
    ) -> list[Replica]:
        """The replicas that may take a request now, sorted by url: HEALTHY, in `pool`, serving
        `model` (None: any), with a breaker CLOSED or HALF_OPEN, and with `version_label` when
        one is given. Runs `expire()` first.

        Raises:
            InvalidParameterError: the pool is unknown.
        """
        _check_pool(pool)
        self.expire()
        return [
            r
            for r in self.all()
            if r.status is ReplicaStatus.HEALTHY
            and r.pool == pool
            and r.serves(model)
            and (version_label is None or r.version_label == version_label)
            and r.breaker.state is not BreakerState.OPEN
        ]

    def models(self) -> list[str]:
        """The union of the HEALTHY replicas' models (both pools), sorted. Runs `expire()`."""
        self.expire()
        healthy = (r for r in self._replicas.values() if r.status is ReplicaStatus.HEALTHY)
        return sorted({model for r in healthy for model in r.models})

    def counts(self) -> dict[ReplicaStatus, int]:
        """How many replicas are in each status (every status, 0 included). Runs `expire()`."""
        self.expire()
        out = dict.fromkeys(ReplicaStatus, 0)
        for replica in self._replicas.values():
            out[replica.status] += 1
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        """JSON of every replica, sorted by url (for a debug endpoint or logs)."""
        now_s = self._clock.monotonic()
        return [
            {
                "url": r.url,
                "models": list(r.models),
                "version_label": r.version_label,
                "pool": r.pool,
                "static": r.static,
                "status": str(r.status),
                "capacity": r.capacity,
                "max_model_len": r.max_model_len,
                "inflight": r.inflight,
                "probe_ok": r.probe_ok,
                "breaker": r.breaker.state.value,
                "load": asdict(r.load),
                "heartbeat_age_s": (
                    None if r.last_heartbeat_s is None else now_s - r.last_heartbeat_s
                ),
            }
            for r in self.all()
        ]

    def _fresh(self, replica: Replica) -> bool:
        if replica.last_heartbeat_s is None:
            return False
        return self._clock.monotonic() - replica.last_heartbeat_s < self.heartbeat_timeout_s

    def _new(
        self, url: str, models: tuple[str, ...], version_label: str, capacity: int, static: bool
    ) -> Replica:
        return Replica(
            url=url,
            models=tuple(models),
            version_label=version_label,
            capacity=capacity,
            max_model_len=0,
            load=ReplicaLoad(),
            static=static,
            pool=PRIMARY_POOL,
            status=ReplicaStatus.HEALTHY,
            last_heartbeat_s=None,
            probe_ok=True,
            breaker=CircuitBreaker(self.breaker_config, self._clock),
            observed_ttft=LatencyWindow(self._clock, self.ttft_window_s),
        )


def _check_pool(pool: str) -> None:
    if pool not in POOLS:
        raise InvalidParameterError("pool", f"must be one of {POOLS}, got {pool!r}")
