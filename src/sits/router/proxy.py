"""Forwarding one client request through the fleet: pick a replica, fail over, relay the answer.

For each request (`Proxy.forward`):
1. With tenants: authenticate (401) and admit against the tenant's fleet-wide limits (429); the
   replica then gets the router's key and the tenant in `x-sits-tenant`. Without tenants the
   client's own key passes through.
2. Pick a replica (`Proxy.pick`): the canary split (`pick_canary` at the canary's weight) chooses
   between canary and stable replicas of the model; when every replica of that group is predicted
   over the tenant's TTFT limit (`predict_ttft_p99_s`, `fallback_needed`), or none is left, the
   fallback pool serves; within a group `policy.choose` applies prefix affinity under the load
   bound, else least load. The chosen replica's breaker must `allow()` it, else the next one.
3. Send it (`send_attempt`). A `Failure` (nothing reached the client) is retried on a replica
   not tried yet, up to `max_attempts` in all and within `request_timeout_s`; a 503 `draining`
   takes the replica out of rotation at once. When no replica is left: 503 `no_replica` with
   Retry-After.
4. Relay the answer: a non-streamed body as is; a stream frame by frame (`StreamRelay`), which
   ends with an error event if the replica breaks off mid-stream.
Each outcome reaches the replica's breaker, the router's TTFT window of the replica, the canary
controller and the metrics exactly once. A request's in-flight count on its replica is held
from the send to the end of its answer.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Request
from starlette.responses import Response

from sits.admission import Clock
from sits.core.fleet import CANARY_VERSION_LABEL, REPLICA_HEADER, TENANT_HEADER
from sits.router.attempt import Answer, Failure, close_upstream, error_code, send_attempt
from sits.router.canary import CanaryController, CanaryState, log_canary, pick_canary
from sits.router.limits import FleetLimits, FleetTicket, prompt_text
from sits.router.metrics import RouterMetrics
from sits.router.policy import RouteReason, choose, prefix_key
from sits.router.predictor import fallback_needed, predict_ttft_p99_s
from sits.router.registry import Registry, Replica
from sits.router.relay import StreamRelay
from sits.router.settings import RouterSettings
from sits.server.errors import ServerError
from sits.server.jobs import ClientDisconnected, SSEResponse, run_until_disconnect
from sits.server.qos.admit import presented_key

logger = logging.getLogger(__name__)

# Request headers not passed to a replica (hop-by-hop, recomputed, or the router's to set).
_DROP_REQUEST = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
     "proxy-connection", TENANT_HEADER}
)  # fmt: skip
# Response headers not passed back (recomputed by the router's own response).
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
)


@dataclass(frozen=True, slots=True)
class Pick:
    """A replica chosen for one attempt.

    Attributes:
        replica: the replica (its breaker allowed the attempt).
        reason: why it was chosen.
        is_probe: the attempt is its breaker's half-open probe.
    """

    replica: Replica
    reason: RouteReason
    is_probe: bool


@dataclass(slots=True)
class _Call:
    """One client request on its way (what `forward` decided before the first attempt)."""

    path: str
    content: bytes
    headers: dict[str, str]
    body: Mapping[str, Any] | None
    stream: bool
    strip_usage: bool
    model: str | None
    key: bytes | None
    ttft_limit_s: float
    ticket: FleetTicket | None
    start_s: float


class Proxy:
    """The router's forwarding (rules in the module docstring).

    Args:
        settings: the router's options.
        registry: the replicas.
        canary: the canary controller.
        metrics: the router's metrics.
        limits: tenants and their fleet-wide limits.
        session: the pooled HTTP client session.
        clock: time source (monotonic seconds).
    """

    def __init__(
        self,
        settings: RouterSettings,
        registry: Registry,
        canary: CanaryController,
        metrics: RouterMetrics,
        limits: FleetLimits,
        session: aiohttp.ClientSession,
        clock: Clock,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.canary = canary
        self.metrics = metrics
        self.limits = limits
        self.session = session
        self.clock = clock
        self._rng = random.Random(settings.seed)

    # --- choosing ------------------------------------------------------------------------
    def canary_present(self) -> bool:
        """True while a healthy canary replica is registered."""
        return any(
            r.version_label == CANARY_VERSION_LABEL
            for r in self.registry.candidates(None, "primary")
        )

    def pick(
        self, model: str | None, key: bytes | None, ttft_limit_s: float, tried: set[str]
    ) -> Pick | None:
        """The replica of the next attempt, or None when none is left (see the module doc)."""
        while True:
            choice = self._choose(model, key, ttft_limit_s, tried)
            if choice is None:
                return None
            replica, reason = choice
            allowed = replica.breaker.allow()
            if allowed.allowed:
                return Pick(replica, reason, allowed.is_probe)
            tried.add(replica.url)  # open (or busy half-open) breaker: not this one

    def _choose(
        self, model: str | None, key: bytes | None, ttft_limit_s: float, tried: set[str]
    ) -> tuple[Replica, RouteReason] | None:
        primary = [r for r in self.registry.candidates(model, "primary") if r.url not in tried]
        group, is_canary = self._canary_group(primary)
        fallbacks = [r for r in self.registry.candidates(model, "fallback") if r.url not in tried]
        if fallbacks:
            predictions = [
                predict_ttft_p99_s(r.observed_ttft, r.load, max(r.inflight, 0)) for r in group
            ]
            if not group or fallback_needed(predictions, ttft_limit_s):
                choice = choose(fallbacks, key, self.settings.load_bound)
                if choice is not None:
                    return self.registry.get(choice.url), RouteReason.FALLBACK
        tiebreak = self._rng.randbytes(8) if key is None else None
        choice = choose(group, key, self.settings.load_bound, tiebreak=tiebreak)
        if choice is None:
            return None
        reason = RouteReason.CANARY if is_canary else choice.reason
        return self.registry.get(choice.url), reason

    def _canary_group(self, primary: list[Replica]) -> tuple[list[Replica], bool]:
        """(the replicas of this request's side of the canary split, whether it is the
        canary's); both sides are one group once the canary is promoted."""
        canaries = [r for r in primary if r.version_label == CANARY_VERSION_LABEL]
        if not canaries or self.canary.state is CanaryState.PROMOTED:
            return primary, False
        stable = [r for r in primary if r.version_label != CANARY_VERSION_LABEL]
        if not stable:
            return canaries, True  # nothing else can serve
        if pick_canary(self.canary.weight, self._rng.random()):
            return canaries, True
        return stable, False

    def _max_model_len(self, model: str | None) -> int:
        """The largest context of the replicas serving `model`, tokens (0 when unknown)."""
        lengths = [r.max_model_len for r in self.registry.candidates(model, "primary")]
        return max(lengths, default=0)

    # --- forwarding ----------------------------------------------------------------------
    async def forward(self, request: Request, path: str) -> Response:
        """Answer one client request through the fleet.

        Raises:
            ServerError: 401 / 429 from the tenant's limits; 404 for a model no replica serves;
                503 `no_replica` when no replica could take it now.
        """
        call = await self._prepare(request, path)
        try:
            # A client that leaves while its request is on the way or a non-streamed answer is
            # being made cancels the attempt (its replica then aborts the work).
            return await run_until_disconnect(request.receive, self._attempts(call))
        except ClientDisconnected:
            self._release(call, None)
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except BaseException:
            self._release(call, None)
            raise

    async def _prepare(self, request: Request, path: str) -> _Call:
        start_s = self.clock.monotonic()
        content = await request.body()
        body = _json_object(content)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        stream = bool(body is not None and body.get("stream") is True)
        model = (
            body.get("model") if body is not None and isinstance(body.get("model"), str) else None
        )
        tenant = ticket = None
        strip_usage = False
        if self.limits.enabled:
            tenant = self.limits.authenticate(presented_key(request))
            if body is not None:
                try:
                    ticket = self.limits.admit(tenant, body, self._max_model_len(model))
                except ServerError as exc:
                    if exc.status == 429:
                        self.metrics.rate_limited.labels(tenant.id).inc()
                    raise
                if stream:
                    content, strip_usage = _ask_for_usage(body, content)
            headers["authorization"] = f"Bearer {self.settings.router_key}"
            headers[TENANT_HEADER] = tenant.id
        limit_s = self.settings.fallback_p99_s
        if tenant is not None and tenant.ttft_ms is not None:
            limit_s = tenant.ttft_ms / 1000
        key = prefix_key(tenant.id if tenant else "", prompt_text(body)) if body else None
        return _Call(
            path, content, headers, body, stream, strip_usage, model, key, limit_s, ticket, start_s
        )

    async def _attempts(self, call: _Call) -> Response:
        tried: set[str] = set()
        last: Failure | None = None
        deadline_s = call.start_s + self.settings.request_timeout_s
        for _ in range(self.settings.max_attempts):
            left_s = deadline_s - self.clock.monotonic()
            pick = self.pick(call.model, call.key, call.ttft_limit_s, tried) if left_s > 0 else None
            if pick is None:
                break
            replica = pick.replica
            tried.add(replica.url)
            if last is not None:
                self.metrics.retries.labels(last.kind).inc()
            self.metrics.decisions.labels(pick.reason.value).inc()
            replica.inflight += 1
            try:
                outcome = await send_attempt(
                    self.session,
                    replica.url + call.path,
                    call.content,
                    call.headers,
                    first_byte_timeout_s=min(self.settings.first_byte_timeout_s, left_s),
                )
            except BaseException:
                replica.inflight -= 1
                if pick.is_probe:
                    replica.breaker.release_probe()
                raise
            if isinstance(outcome, Answer):
                return self._answer(call, replica, outcome)
            replica.inflight -= 1
            self._count_failure(replica, outcome, pick.is_probe)
            last = outcome
        if last is None and call.model is not None and not self._known(call.model):
            self._release(call, 0)
            raise ServerError(
                404,
                f"The model `{call.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        self.metrics.no_replica.inc()
        self.metrics.requests.labels("none", "503").inc()
        self._release(call, 0)
        why = f" (last attempt: {last.message})" if last is not None else ""
        target = f"model `{call.model}`" if call.model else "this request"
        raise ServerError(
            503,
            f"No replica can serve {target} now{why}; retry later.",
            type="service_unavailable_error",
            code="no_replica",
            headers={"Retry-After": "1"},
        )

    def _known(self, model: str) -> bool:
        """True when some replica, in rotation or not, serves `model` or has not said what it
        serves."""
        return any(not r.models or model in r.models for r in self.registry.all())

    def _count_failure(self, replica: Replica, failure: Failure, is_probe: bool) -> None:
        self.metrics.errors.labels(replica.url, failure.kind).inc()
        logger.warning("attempt on %s failed: %s", replica.url, failure.message)
        if failure.kind == "draining":
            self.registry.mark_draining(replica.url)
            if is_probe:
                replica.breaker.release_probe()
            return
        replica.breaker.record_failure()
        self._record_canary(replica, None, None, failed=True)

    def _answer(self, call: _Call, replica: Replica, answer: Answer) -> Response:
        headers = {k: v for k, v in answer.headers.items() if k.lower() not in _DROP_RESPONSE}
        headers[REPLICA_HEADER] = replica.url
        if call.ticket is not None:
            headers.update(self.limits.ratelimit_headers(call.ticket.tenant))
        if answer.upstream is None:
            assert answer.body is not None
            # A replica shedding work under overload (its QoS) is not failing.
            failed = answer.status >= 500 and error_code(answer.body) != "overloaded"
            self._end(call, replica, answer.status, failed, None, None, _usage_total(answer.body))
            return Response(answer.body, status_code=answer.status, headers=headers)
        assert answer.chunks is not None

        def on_first_frame(now_s: float) -> None:
            ttft_s = now_s - call.start_s
            replica.observed_ttft.add(ttft_s)
            self.metrics.ttft.labels(replica.url).observe(ttft_s)

        relay = StreamRelay(
            answer.first_chunk,
            answer.chunks,
            self.clock,
            strip_usage=call.strip_usage,
            on_first_frame=on_first_frame,
        )
        upstream = answer.upstream

        async def on_close() -> None:
            close_upstream(upstream, whole=relay.saw_done)
            if relay.failed:
                self.metrics.errors.labels(replica.url, "stream_cut").inc()
                logger.warning(
                    "stream from %s failed after %d events (the client got an error event)",
                    replica.url, relay.num_frames,
                )  # fmt: skip
            ttft_s = None if relay.first_frame_s is None else relay.first_frame_s - call.start_s
            self._end(call, replica, 200, relay.failed, ttft_s, relay.tpot_s(), relay.total_tokens)

        response = SSEResponse(relay.frames(), on_close)
        for name, value in headers.items():
            if name.lower() not in ("content-type", "cache-control"):
                response.headers[name] = value
        return response

    def _end(
        self,
        call: _Call,
        replica: Replica,
        status: int,
        failed: bool,
        ttft_s: float | None,
        tpot_s: float | None,
        total_tokens: int | None,
    ) -> None:
        """Account one answered request exactly once (breaker, windows, canary, metrics)."""
        replica.inflight -= 1
        if failed:
            replica.breaker.record_failure()
        else:
            replica.breaker.record_success()
        self.metrics.e2e.labels(replica.url).observe(self.clock.monotonic() - call.start_s)
        self.metrics.requests.labels(replica.url, str(status)).inc()
        self._record_canary(replica, ttft_s, tpot_s, failed)
        self._release(call, total_tokens)

    def _record_canary(
        self, replica: Replica, ttft_s: float | None, tpot_s: float | None, failed: bool
    ) -> None:
        if self.canary_present() or self.canary.state is not CanaryState.INACTIVE:
            self.canary.record(
                replica.version_label == CANARY_VERSION_LABEL, ttft_s, tpot_s, failed
            )
            decision = self.canary.evaluate(self.canary_present())
            if decision is not None:
                log_canary(decision)

    def _release(self, call: _Call, total_tokens: int | None) -> None:
        if call.ticket is not None:
            self.limits.release(call.ticket, total_tokens)
            call.ticket = None


def _json_object(content: bytes) -> Mapping[str, Any] | None:
    """The request body as a JSON object, or None (the replica answers a malformed one)."""
    try:
        body = json.loads(content)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _ask_for_usage(body: Mapping[str, Any], content: bytes) -> tuple[bytes, bool]:
    """(the body to send, whether the router added the usage chunk): a stream's usage reconciles
    the tenant's token budget, so the router asks for it and drops it if the client did not."""
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return content, False
    if options is not None and not isinstance(options, dict):
        return content, False  # malformed: the replica answers it
    rewritten = dict(body)
    rewritten["stream_options"] = {**(options or {}), "include_usage": True}
    return json.dumps(rewritten, ensure_ascii=False).encode(), True


def _usage_total(body: bytes) -> int | None:
    """`usage.total_tokens` of a JSON answer, or None."""
    parsed = _json_object(body)
    usage = parsed.get("usage") if parsed is not None else None
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) else None
