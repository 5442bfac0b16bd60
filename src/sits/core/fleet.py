"""The fleet's wire messages between `sits serve` replicas and `sits router`.

A replica started with `--register-with ROUTER_URL` posts a `Heartbeat` (who it is and its load)
to `REGISTER_PATH` once and then to `HEARTBEAT_PATH` every `HEARTBEAT_INTERVAL_S`, with the
router's key as its bearer key; on a drain it posts to `DEREGISTER_PATH`. The router takes a
replica out after `MISSED_HEARTBEATS` intervals without one. Requests the router forwards carry
the tenant's id in `TENANT_HEADER`; a replica honours that header only when the request's bearer
key is the router's key (`--router-key`).

Plain frozen dataclasses with JSON round-trips, so both sides (which never import each other)
share one definition. `from_json` refuses malformed messages with `InvalidParameterError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sits.core.errors import InvalidParameterError

REGISTER_PATH = "/v1/router/register"
HEARTBEAT_PATH = "/v1/router/heartbeat"
DEREGISTER_PATH = "/v1/router/deregister"
TENANT_HEADER = "x-sits-tenant"
REPLICA_HEADER = "x-sits-replica"  # set by the router on responses: the replica that served
HEARTBEAT_INTERVAL_S = 2.0
MISSED_HEARTBEATS = 3
OVERLOAD_STATES = ("green", "yellow", "red")
DEFAULT_VERSION_LABEL = "stable"
CANARY_VERSION_LABEL = "canary"


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A replica's load when it sent its heartbeat.

    Attributes:
        num_running: engine requests running (holding KV blocks).
        num_waiting: engine requests queued.
        kv_cache_usage: fraction of KV blocks in use, 0..1.
        overload_state: "green", "yellow" or "red" (`sits.admission.OverloadState`).
        ttft_p50_s, ttft_p99_s: recent time-to-first-token percentiles, seconds; None without
            recent requests.
        tpot_p50_s, tpot_p99_s: recent time-per-output-token percentiles, seconds; None likewise.
        draining: the replica is shutting down (SIGTERM) and takes no new work.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    overload_state: str = "green"
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    draining: bool = False

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidParameterError(name, f"must be an integer >= 0, got {value!r}")
        if not _is_number(self.kv_cache_usage) or not 0 <= self.kv_cache_usage <= 1:
            raise InvalidParameterError(
                "kv_cache_usage", f"must be in [0, 1], got {self.kv_cache_usage!r}"
            )
        if self.overload_state not in OVERLOAD_STATES:
            raise InvalidParameterError(
                "overload_state", f"must be one of {OVERLOAD_STATES}, got {self.overload_state!r}"
            )
        for name in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and value >= 0):
                raise InvalidParameterError(name, f"must be null or a number >= 0, got {value!r}")
        if not isinstance(self.draining, bool):
            raise InvalidParameterError("draining", f"must be a boolean, got {self.draining!r}")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A replica's registration and heartbeat message (the same message for both).

    Attributes:
        url: the base URL the router reaches the replica at, e.g. "http://127.0.0.1:8001".
        models: the model names it serves (`/v1/models` ids).
        version_label: "stable", "canary" or another label (`--version-label`).
        capacity: the most requests it runs at once (the engine's max_num_seqs), >= 1.
        max_model_len: its context length, tokens.
        load: its load now.
    """

    url: str
    models: tuple[str, ...]
    version_label: str = DEFAULT_VERSION_LABEL
    capacity: int = 1
    max_model_len: int = 0
    load: ReplicaLoad = field(default_factory=ReplicaLoad)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise InvalidParameterError("url", f"must be an http(s) URL, got {self.url!r}")
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise InvalidParameterError("models", f"must be non-empty names, got {self.models!r}")
        if not isinstance(self.version_label, str) or not self.version_label:
            raise InvalidParameterError("version_label", "must be a non-empty string")
        for name, low in (("capacity", 1), ("max_model_len", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidParameterError(name, f"must be an integer >= {low}, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this message."""
        body = asdict(self)
        body["models"] = list(self.models)
        return body

    @classmethod
    def from_json(cls, body: Any) -> Heartbeat:
        """Parse a JSON object.

        Raises:
            InvalidParameterError: not an object, a missing or unknown field, a bad value.
        """
        if not isinstance(body, Mapping):
            raise InvalidParameterError("body", "must be a JSON object")
        _no_unknown(body, ("url", "models", "version_label", "capacity", "max_model_len", "load"))
        if "url" not in body or "models" not in body:
            raise InvalidParameterError("body", "needs 'url' and 'models'")
        load = body.get("load", {})
        if not isinstance(load, Mapping):
            raise InvalidParameterError("load", "must be a JSON object")
        _no_unknown(load, ReplicaLoad.__dataclass_fields__)
        models = body["models"]
        if not isinstance(models, list | tuple):
            raise InvalidParameterError("models", "must be a list of names")
        kwargs = {k: body[k] for k in ("version_label", "capacity", "max_model_len") if k in body}
        return cls(url=body["url"], models=tuple(models), load=ReplicaLoad(**load), **kwargs)


def normalize_url(url: str) -> str:
    """`url` without a trailing slash (the registry's key for a replica)."""
    return url.rstrip("/")


def _no_unknown(body: Mapping[str, Any], known: Any) -> None:
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise InvalidParameterError(unknown[0], f"unknown field(s): {', '.join(unknown)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
