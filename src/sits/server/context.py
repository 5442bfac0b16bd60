"""`ServerSettings` (what the CLI decides), `ServerContext` (what every handler uses) and
`ServerLifecycle` (admission while serving, drain on SIGTERM, reaction to engine death).

One context per app: the engine, the settings, the lifecycle (drain, health), the QoS state
(tenants, rate limits, breaker, overload) with its watcher, the metrics, and the fleet pieces
(the heartbeat task of `--register-with`, the fault injector of `--fault-injection`).
Handlers get it from `request.app.state.ctx`; nothing is global.

Lifecycle states: serving -> draining (SIGTERM) -> stopped, or serving -> engine dead (loop
died/hung). Invariants:
- While draining or once the engine is unhealthy, `admit()` raises 503 at once: new requests
  never wait on an engine that will not serve them.
- `drain()` sets `drain_started` at once (the fleet registration deregisters on it, a hung
  injected fault answers on it), lets admitted requests finish for up to
  `shutdown_timeout_s`, then fails the jobs still open with a 503 error (streams end with an
  error event) and returns whether the drain was clean (nothing cut).
- The monitor polls `engine.is_healthy()`; when it turns False every open job fails at once
  with `EngineDeadError` and `on_fatal(exit_code)` asks the process to exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from sits.admission.precision_policy import PrecisionPolicySettings
from sits.core.errors import EngineDeadError, InvalidParameterError
from sits.core.sampling_params import MAX_LOGPROBS
from sits.obs.cost_metrics import CostCollector
from sits.obs.loop_lag import EventLoopLagMonitor, starvation_advice
from sits.obs.request_audit import AuditSettings, ServerAudit
from sits.obs.server_metrics import ServerMetrics
from sits.obs.tenant_metrics import TenantMetrics
from sits.obs.tracing import TracingSettings
from sits.server.engine_client import EngineClient, ServerTokenizer
from sits.server.errors import draining_error, model_not_found, unavailable
from sits.server.faults import FaultInjector, FaultSpec
from sits.server.jobs import EnginePrompt, GenerationJob
from sits.server.precision import PrecisionCollector, PrecisionSwitcher
from sits.server.qos.admit import QosSettings, ServerQos
from sits.server.qos.metrics import QosCollector
from sits.server.qos.overload_watch import OverloadWatcher
from sits.server.registration import FleetRegistration, RegistrationSettings
from sits.server.request_tracing import (
    NO_TRACE,
    NoOpTrace,
    RequestTrace,
    RequestTracer,
    request_trace,
)
from sits.tenancy import TenantConfig, TenantsConfig

T = TypeVar("T")

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 1
_CUT_STREAMS_FLUSH_S = 2.0


@dataclass(frozen=True, slots=True)
class CorsSettings:
    """Cross-origin resource sharing (`--allowed-origins` and the other CORS flags, as in
    vLLM; Starlette's `CORSMiddleware` answers preflights and adds the headers).

    Attributes:
        allowed_origins: origins a browser may call from ("*": any).
        allowed_methods: HTTP methods allowed cross-origin.
        allowed_headers: request headers allowed cross-origin.
        allow_credentials: allow cookies and HTTP authentication cross-origin.
    """

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server options (flag names follow `vllm serve`).

    Attributes:
        served_model_name: the name clients pass as `model`; None = the engine's model name.
        api_key: when set, /v1, /tokenize and /detokenize need `Authorization: Bearer KEY`.
        model_root: the checkpoint directory, shown in /v1/models.
        random_weights: the weights are random (untrained demo): said in /v1/models.
        model_description: a plain sentence for /v1/models.
        shutdown_timeout_s: how long SIGTERM waits for in-flight requests.
        health_poll_s: how often the engine's health is checked.
        tenants: the tenants (`--tenants`): keys, tiers, limits, SLOs; their ids also salt
            the prefix cache. None: one default tenant (`TenantsConfig.default(api_key)`).
        qos: rate-limit window, breaker, overload thresholds and clock.
        enable_prompt_tokens_details: fill `usage.prompt_tokens_details.cached_tokens`
            (vLLM's flag of the same name; off by default, as in vLLM).
        audit: the audit log options (`--audit-log`); None = no audit log.
        admin_key: the bearer key of the /v1/admin routes (`--admin-key`); None = those routes
            answer 404.
        tracing: OpenTelemetry tracing (`--otlp-traces-endpoint`, `--trace-sample-ratio`);
            None = off.
        gpu_price_per_hour: price of one GPU-hour (`--gpu-price-per-hour`) for the cost
            metrics (`sits.obs.cost_metrics`); 0 = no cost metrics.
        router_key: the fleet router's bearer key (`--router-key`): the key of the heartbeat
            posts, and the only key whose requests may name their tenant in `x-sits-tenant`
            (`sits.server.trusted`); None = no router.
        registration: register with a fleet router and send it heartbeats (`--register-with`,
            `sits.server.registration`); None = not part of a fleet (needs `router_key`).
        fault_injection: the faults injected into generation requests (`--fault-injection`,
            `sits.server.faults`); None = off (the default).
        precision_policy: who switches the weights' precision with `--precision-switch`
            (`--precision-policy`, `sits.admission.precision_policy`); manual by default.
        served_model_aliases: further names clients may pass as `model` (the later names of
            `--served-model-name a b c`); /v1/models lists every name, responses carry the
            first.
        sampling_defaults: the sampling parameters a request leaves unset take these values
            (`--generation-config`: the model's generation_config.json, as vLLM does):
            temperature, top_p, top_k, min_p, repetition_penalty, and max_tokens (the most
            any request may generate, vLLM's reading of max_new_tokens).
        max_logprobs: the most logprobs (and top_logprobs) a request may ask for
            (`--max-logprobs`).
        log_requests: log one line per generation request (`--enable-log-requests`).
        max_log_len: the most prompt characters such a line shows (None: all).
        cors: the CORS headers (`--allowed-origins` ...); None: no CORS middleware.

    Raises:
        InvalidParameterError: both `api_key` and `tenants` (keys belong in tenants.toml), a
            negative or non-finite GPU price, or `registration` without `router_key`.
    """

    served_model_name: str | None = None
    api_key: str | None = None
    model_root: str | None = None
    random_weights: bool = False
    model_description: str | None = None
    shutdown_timeout_s: float = 30.0
    health_poll_s: float = 0.2
    tenants: TenantsConfig | None = None
    qos: QosSettings = field(default_factory=QosSettings)
    enable_prompt_tokens_details: bool = False
    audit: AuditSettings | None = None
    admin_key: str | None = None
    tracing: TracingSettings | None = None
    gpu_price_per_hour: float = 0.0
    router_key: str | None = None
    registration: RegistrationSettings | None = None
    fault_injection: FaultSpec | None = None
    precision_policy: PrecisionPolicySettings = field(default_factory=PrecisionPolicySettings)
    served_model_aliases: tuple[str, ...] = ()
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    max_logprobs: int = MAX_LOGPROBS
    log_requests: bool = False
    max_log_len: int | None = None
    cors: CorsSettings | None = None

    def __post_init__(self) -> None:
        if self.registration is not None and not self.router_key:
            raise InvalidParameterError(
                "router_key",
                "--register-with needs the router's key: --router-key KEY or $SITS_ROUTER_KEY",
            )
        if not (math.isfinite(self.gpu_price_per_hour) and self.gpu_price_per_hour >= 0):
            raise InvalidParameterError(
                "gpu_price_per_hour", f"must be a number >= 0, got {self.gpu_price_per_hour}"
            )
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise InvalidParameterError(
                "max_logprobs",
                f"max_logprobs must be in [0, {MAX_LOGPROBS}] (the most sits' sampler "
                f"returns), got {self.max_logprobs}",
            )
        if self.api_key is not None and self.tenants is not None:
            raise InvalidParameterError(
                "api_key",
                "--api-key and --tenants exclude each other: with tenants, API keys are the "
                "tenants' api_key_sha256 entries",
            )

    def tenants_config(self) -> TenantsConfig:
        """The configured tenants, or the single default tenant (with `api_key` if any)."""
        return self.tenants if self.tenants is not None else TenantsConfig.default(self.api_key)


class Ticket:
    """One admitted HTTP request; `release()` (idempotent) ends it for the drain's count."""

    def __init__(self, lifecycle: ServerLifecycle) -> None:
        self._lifecycle = lifecycle
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._lifecycle._release()


class ServerLifecycle:
    """Tracks admitted requests and open jobs; drains; watches the engine's health.

    Args:
        engine: the engine front end.
        shutdown_timeout_s: how long a drain waits for admitted requests.
        health_poll_s: how often the monitor calls `engine.is_healthy()`.
        on_fatal: called once with an exit code when the engine dies (the CLI stops the
            process); None to only fail requests and report unhealthy.
    """

    def __init__(
        self,
        engine: EngineClient,
        *,
        shutdown_timeout_s: float = 30.0,
        health_poll_s: float = 0.2,
        on_fatal: Callable[[int], None] | None = None,
    ) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.health_poll_s = health_poll_s
        self.on_fatal = on_fatal
        self.draining = False
        self.cut = False  # the drain timed out: jobs registered from now on fail at once
        self.engine_dead = False
        self.num_admitted = 0
        self._jobs: set[GenerationJob] = set()
        self.drain_started = asyncio.Event()  # set by the first `drain()`
        # Set by `sits.server.uvicorn_server.DrainingServer` once its sockets accept
        # connections, with the port bound (useful with port 0); never set for an app served
        # otherwise.
        self.listening = asyncio.Event()
        self.bound_port: int | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._monitor: asyncio.Task[None] | None = None

    # --- serving ---------------------------------------------------------------------------
    def healthy(self) -> bool:
        """True while the engine loop is alive and stepping (never blocks)."""
        if self.engine_dead:
            return False
        try:
            return bool(self.engine.is_healthy())
        except Exception:  # noqa: BLE001 - a failing health probe means unhealthy
            return False

    def stall_reason(self) -> str | None:
        """Why the engine's running step counts as stalled, or None (an engine without the
        check, or a failing probe: None; `healthy` judges those)."""
        probe = getattr(self.engine, "stall_reason", None)
        if probe is None:
            return None
        try:
            return probe()
        except Exception:  # noqa: BLE001 - the health probe must not fail
            return None

    def admit(self) -> Ticket:
        """Admit one request.

        Raises:
            ServerError: 503 while draining or when the engine is not healthy.
        """
        if self.draining:
            raise draining_error()
        if not self.healthy():
            raise unavailable("The engine is not running; retry on another replica.", "engine_dead")
        self.num_admitted += 1
        self._idle.clear()
        return Ticket(self)

    def _release(self) -> None:
        self.num_admitted -= 1
        assert self.num_admitted >= 0
        if self.num_admitted == 0:
            self._idle.set()

    def add_job(self, job: GenerationJob) -> None:
        """Register an open job so a drain timeout or engine death can fail it."""
        if self.engine_dead:
            raise EngineDeadError(str(self.engine.dead_error or "the engine loop stopped"))
        if self.cut:
            raise draining_error()
        self._jobs.add(job)

    def remove_job(self, job: GenerationJob) -> None:
        self._jobs.discard(job)

    # --- engine health ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the health monitor (call from the running event loop)."""
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch_engine())

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(self.health_poll_s)
            if not self.healthy():
                self.mark_engine_dead()
                return

    def mark_engine_dead(self) -> None:
        """Fail every open job with EngineDeadError and ask the process to exit non-zero."""
        if self.engine_dead:
            return
        self.engine_dead = True
        cause = self.engine.dead_error
        message = f"the engine loop stopped ({cause!r})" if cause else "the engine loop stopped"
        logger.error(
            "engine is unhealthy: %s; failing %d open request(s)", message, len(self._jobs)
        )
        for job in list(self._jobs):
            job.fail(EngineDeadError(message))
        if self.on_fatal is not None:
            self.on_fatal(ENGINE_DEAD_EXIT_CODE)

    # --- shutdown --------------------------------------------------------------------------
    async def drain(self) -> bool:
        """Refuse new requests, let admitted ones finish, then cut what is left.

        Returns:
            True when every admitted request finished within `shutdown_timeout_s`.
        """
        self.draining = True
        self.drain_started.set()
        logger.info(
            "draining: %d request(s) in flight, waiting up to %.1f s",
            self.num_admitted,
            self.shutdown_timeout_s,
        )
        try:
            await asyncio.wait_for(self._idle.wait(), self.shutdown_timeout_s)
            return True
        except TimeoutError:
            pass
        logger.warning("drain timeout: cutting %d open request(s)", len(self._jobs))
        await self.cut_open_requests()
        return False

    async def cut_open_requests(self) -> None:
        """Refuse new requests and fail every open one with the draining error (a stream
        ends with its error event), then wait up to `_CUT_STREAMS_FLUSH_S` for the handlers
        to write them. Idempotent."""
        self.draining = True
        self.drain_started.set()
        self.cut = True
        for job in list(self._jobs):
            job.fail(draining_error())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), _CUT_STREAMS_FLUSH_S)

    async def stop(self) -> None:
        """Stop the health monitor."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None


class ServerContext:
    """Everything a handler needs; one per app.

    Args:
        engine: the engine front end.
        settings: server options.
        lifecycle: drain and health.

    Attributes:
        qos: tenants, rate limits, circuit breaker and overload state.
        overload_watcher: the task feeding `qos` with the engine's load (started by the app).
        loop_lag: the task measuring the asyncio loop's lag (started by the app).
        metrics: the server's metrics (per tenant too).
        cost: the cost metrics (GPU-seconds per tenant, cost per 1M tokens).
        audit: the audit log (opened by the app's lifespan), or None.
        tracer: the request tracer (`sits.server.request_tracing`), or None when tracing is off.
        tokenize_executor: the one thread that tokenizes prompts (`run_tokenizer`); shut down
            by the app's lifespan.
        registration: the fleet heartbeat task (started and stopped by the app's lifespan),
            or None without `settings.registration`.
        faults: the fault injector, or None without `settings.fault_injection`.
        precision: the operator's and the policy's switches of the weights' precision (its
            policy task is started by the app).

    Raises:
        InvalidParameterError: `--precision-policy overload` on an engine without a
            precision switch.
    """

    def __init__(
        self, engine: EngineClient, settings: ServerSettings, lifecycle: ServerLifecycle
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.lifecycle = lifecycle
        self.model_name = settings.served_model_name or engine.model_name
        tenants = settings.tenants_config()
        self.metrics = ServerMetrics(engine, self.model_name)
        tenant_metrics = TenantMetrics(self.metrics.registry, self.model_name, tenants)
        self.metrics.tenants = tenant_metrics
        self.qos = ServerQos(
            engine,
            tenants,
            settings.qos,
            tenant_metrics,
            isolate_prefix_cache=settings.tenants is not None,
        )
        self.overload_watcher = OverloadWatcher(engine, self.qos)
        device = getattr(getattr(getattr(engine, "info", None), "device", None), "type", None)
        self.loop_lag = EventLoopLagMonitor(
            self.metrics.registry,
            self.model_name,
            advice=starvation_advice(device, getattr(engine, "pid", None) is not None),
            is_idle=lambda: lifecycle.num_admitted == 0,
        )
        self.tokenize_executor = ThreadPoolExecutor(1, thread_name_prefix="sits-tokenize")
        self.audit: ServerAudit | None = None
        if settings.audit is not None:
            config = getattr(engine, "config", None)
            model_dir = settings.model_root or getattr(config, "model", None)
            self.audit = ServerAudit(settings.audit, self.model_name, model_dir)
        self.tracer: RequestTracer | None = None
        if settings.tracing is not None:
            self.tracer = RequestTracer(settings.tracing, self.model_name)
            record_timeline = getattr(engine, "record_timeline", None)
            if record_timeline is not None:  # prefill chunks and detokenize time for the spans
                record_timeline(True)
        self.metrics.registry.register(
            QosCollector(self.qos, engine.stats, self.overload_watcher.snapshot, self.model_name)
        )
        self.cost = CostCollector(
            engine.stats, tenants, tenant_metrics, self.model_name, settings.gpu_price_per_hour
        )
        self.metrics.registry.register(self.cost)
        self.precision = PrecisionSwitcher(
            engine,
            settings.precision_policy,
            lambda: self.qos.overload_state,
            self.qos.clock,
            settings.qos.overload_poll_s,
        )
        self.metrics.registry.register(PrecisionCollector(engine, self.model_name))
        self.registration: FleetRegistration | None = None
        if settings.registration is not None:
            assert settings.router_key is not None  # checked by ServerSettings
            self.registration = FleetRegistration(
                settings.registration,
                settings.router_key,
                engine=engine,
                lifecycle=lifecycle,
                model_name=self.model_name,
                overload_state=lambda: self.qos.overload_state.value,
                timelines=self.metrics.timelines,
            )
        self.faults: FaultInjector | None = None
        if settings.fault_injection is not None:
            self.faults = FaultInjector(
                settings.fault_injection, self.metrics.registry, self.model_name
            )

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the tokenizer thread, with the caller's context variables.

        Tokenizing off the event loop keeps one huge prompt from stalling every other request;
        one thread keeps the (stateful) fast tokenizer from running two encodes at once.

        Raises:
            Whatever `fn` raises.
        """
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self.tokenize_executor, context.run, fn, *args)

    @property
    def tokenizer(self) -> ServerTokenizer:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def fill_cap(self, cap: int | None, num_prompt_tokens: int) -> int | None:
        """`cap` (the most an unset max_tokens stands for) lowered to what the engine's KV
        cache holds after the prompt, when the engine tells its cache (`num_kv_blocks`,
        `block_size`): a context longer than the cache (`--max-model-len` set so) then fills
        the cache, not the context. A prompt the cache cannot hold keeps `cap`: the engine
        refuses it with the cache's numbers."""
        num_kv_blocks = getattr(self.engine, "num_kv_blocks", None)
        block_size = getattr(self.engine, "block_size", None)
        if num_kv_blocks is None or block_size is None:
            return cap
        room = num_kv_blocks * block_size - num_prompt_tokens
        if room < 1:
            return cap
        return room if cap is None else min(cap, room)

    def trace_of(self, request: Request) -> RequestTrace | NoOpTrace:
        """The request's trace; `NO_TRACE` (its calls do nothing) while tracing is off, decided
        by one check without looking at the request."""
        return NO_TRACE if self.tracer is None else request_trace(request)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name this server answers to, the response's name first."""
        aliases = [n for n in self.settings.served_model_aliases if n != self.model_name]
        return (self.model_name, *dict.fromkeys(aliases))

    def check_model(self, name: str | None) -> None:
        """Raise 404 unless `name` is None or one of the served model's names."""
        if name is not None and name not in self.model_names:
            raise model_not_found(name)

    def new_job(
        self,
        prefix: str,
        prompts: list[EnginePrompt],
        tenant: TenantConfig,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        received_s: float | None = None,
    ) -> GenerationJob:
        """A job of `tenant` for `prompts` with a fresh request id `prefix-<hex>` and metrics
        attached; its prefix-cache namespace is `ServerQos.cache_salt(tenant, cache_salt)`;
        `received_s`: the HTTP request's receipt (`sits.server.request_tracing.received_at`)."""
        return GenerationJob(
            self.engine,
            f"{prefix}-{uuid.uuid4().hex}",
            prompts,
            tenant_id=tenant.id,
            priority=priority,
            cache_salt=self.qos.cache_salt(tenant, cache_salt),
            make_observer=lambda prompt: self.metrics.recorder(prompt, tenant, received_s),
            audit=self.audit,
        )
