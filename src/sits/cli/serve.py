"""`sits serve`: the OpenAI-compatible HTTP server (flag names follow `vllm serve`).

`add_serve_parser(subparsers)` declares the subcommand; `run_serve(args)` loads the engine,
builds the app and serves until SIGTERM (exit 0 after the drain) or engine death (exit 1).
With no model the built-in demo model `sits-demo` is served (`sits.demo`). The API key comes
from --api-key, --api-key-file or else the SITS_API_KEY environment variable, read here at run
time (`cli.key_flags`: the file and the variable keep it out of `ps`); the admin key of
/v1/admin (which also protects /dashboard/data) likewise from --admin-key, --admin-key-file or
SITS_ADMIN_KEY.
With `--tenants tenants.toml` the tenants (keys, tiers, limits, SLOs) are loaded before any
model work; a malformed file exits 2 with the file, line and field named, and an API key
besides is refused (keys belong to the tenants). Without it: one default tenant and plain
FCFS scheduling. With `--engine-process` the engine's step loop runs in a child process
(`AsyncLLM(engine_process=True)`) instead of a thread beside the HTTP loop. The fleet flags
(`--register-with`, `--router-key`, `--fault-injection`, ...) are in `sits.cli.fleet_flags`.
`--precision-policy overload` (with `--precision-red-seconds` / `--precision-green-seconds`)
lets the overload state switch the weights of `--precision-switch`; without that flag it is
refused before the model loads (exit 2). So is a busy `--host`/`--port` (`check_port_free`):
the port is tried before any model work, not after a long load. A `--tensor-parallel-size`
the model's heads, KV heads or vocabulary do not fit is refused (exit 2, one line) before any
worker process starts (`sits.cli.tp_check`). vLLM's server flags (several
`--served-model-name`, `--chat-template`, `--generation-config`, CORS, `--root-path`, HTTPS,
request logging) are in `sits.cli.vllm_flags`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sits.cli.flags import flag_prefix, non_negative_number, port_number, positive_seconds
from sits.cli.fleet_flags import (
    add_fleet_args,
    fault_injection_arg,
    registration_arg,
    resolve_router_key,
)
from sits.cli.key_flags import add_secret_args, resolve_secret
from sits.cli.tp_check import check_tensor_parallel_fit
from sits.cli.vllm_flags import (
    add_vllm_server_args,
    chat_template_arg,
    cors_arg,
    max_logprobs_arg,
    sampling_defaults_arg,
    served_names_arg,
    uvicorn_kwargs_arg,
)
from sits.config import ADMIN_KEY_ENV, API_KEY_ENV, ROUTER_KEY_ENV, TRACING_ENVS, env_values
from sits.core.errors import InvalidParameterError
from sits.core.sampling_params import MAX_LOGPROBS
from sits.engine.arg_utils import ENGINE_STEP_TIMEOUT_S, add_engine_args, engine_kwargs
from sits.server.http_impl import HTTP_CHOICES, LOOP_CHOICES

if TYPE_CHECKING:
    from sits.tenancy import TenantsConfig

EXIT_BAD_CONFIG = 2
# Thread switch interval of the server process: 0.2 ms cuts the GIL convoy's cost per HTTP
# system call ~13x against CPython's 5 ms (measured with a Python-busy thread beside a socket
# loop), for a few % of engine-thread time while both threads are busy.
DEFAULT_GIL_SWITCH_INTERVAL_MS = 0.2


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API. With no model, serve "
        "the built-in demo model 'sits-demo' (shipped with sits, no download).",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="as --model")
    add_engine_args(p, model_required=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port, 0-65535 (default 8000)")
    add_vllm_server_args(p)  # --served-model-name, --chat-template, CORS, SSL, ...
    add_secret_args(p, "api-key", API_KEY_ENV, "require this bearer key")
    add_secret_args(
        p,
        "admin-key",
        ADMIN_KEY_ENV,
        "enable /v1/admin (MoE expert stats, freeze/unfreeze; the weights' precision with "
        "--precision-switch) with this bearer key; the key also protects the dashboard's data, "
        "/dashboard/data (401 without it, 403 with a wrong one). Without it the admin routes "
        "answer 404 and /dashboard/data is open, like /metrics",
    )
    p.add_argument(
        "--expert-freeze-after",
        type=int,
        default=3,
        metavar="N",
        help="freeze an MoE expert after N consecutive checks with non-finite outputs "
        "(0 = never; default 3)",
    )
    p.add_argument(
        "--restore-frozen-experts",
        action="store_true",
        help="reload an automatically frozen MoE expert from the checkpoint and unfreeze it",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants.toml: API keys (SHA-256), tiers, reservations, SLOs and rate limits; "
        "enables per-tenant auth, admission control and QoS scheduling",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (prefix-cache hits)",
    )
    p.add_argument(
        "--audit-log",
        default=None,
        metavar="PATH",
        help="write one tamper-evident record per finished request (and per refused "
        "generation request) to PATH, mode 0600 (`sits audit verify`)",
    )
    p.add_argument(
        "--audit-key-file",
        default=None,
        metavar="PATH",
        help="the audit key (>= 16 bytes, mode 0600, kept outside the log): records are "
        "HMAC-SHA256-chained and inputs HMAC-hashed with it, checkpoints signed; without it the "
        "chain is plain SHA-256 and cannot reveal a rewritten or cut tail",
    )
    p.add_argument(
        "--audit-checkpoint-file",
        default=None,
        metavar="PATH",
        help="append a checkpoint (record count, head hash, time; signed with the key) to PATH "
        "every --audit-checkpoint-interval records and at shutdown; keep it out of the "
        "server's reach (`sits audit verify --checkpoints`)",
    )
    p.add_argument(
        "--audit-checkpoint-interval",
        type=int,
        default=100,
        metavar="N",
        help="records between two audit checkpoints (default 100)",
    )
    p.add_argument(
        "--audit-top-logprobs",
        type=int,
        default=5,
        metavar="K",
        help="alternatives (top-K logprobs) audited per generated token (default 5)",
    )
    p.add_argument(
        "--audit-max-file-bytes",
        type=int,
        default=None,
        metavar="N",
        help="rotate the audit log before it grows past N bytes (default 256 MiB)",
    )
    p.add_argument(
        "--audit-store-input",
        action="store_true",
        help="store the input text itself in the audit log (else only its keyed HMAC)",
    )
    p.add_argument(
        "--gpu-price-per-hour",
        type=non_negative_number,
        default=0.0,
        metavar="PRICE",
        help="price of one GPU-hour: exports each tenant's cost and cost per 1M tokens in "
        "/metrics and on /dashboard (default 0 = off; GPU-seconds per tenant are always "
        "exported)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one OpenTelemetry trace per request over OTLP/HTTP to URL (e.g. "
        "http://localhost:4318/v1/traces; a URL without a path gets /v1/traces), or over "
        "OTLP/gRPC to grpc://HOST:PORT (grpcs:// with TLS; or an http URL with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc); tracing is "
        "also on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set, "
        "and the other OTEL_* variables (headers, timeout, service name) apply",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=None,
        metavar="R",
        help="fraction in [0, 1] of ordinary traces kept (default $OTEL_TRACES_SAMPLER_ARG, "
        "else 1); traces of failed requests and of requests over their SLO are always kept",
    )
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=DEFAULT_GIL_SWITCH_INTERVAL_MS,
        metavar="MS",
        help="how long (ms) one thread may hold Python's GIL while another waits for it "
        f"(default {DEFAULT_GIL_SWITCH_INTERVAL_MS}; CPython's own is 5): the engine's step "
        "thread and the HTTP loop share the GIL, and a smaller value keeps the HTTP side (and "
        "so TTFT/ITL under load) from waiting behind the engine's kernel launches; see "
        "sits:event_loop_lag_seconds. With --engine-process it only paces the server's own "
        "threads (tokenizer, pipe reader and writer)",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine's step loop in its own process instead of a thread of the server "
        "process: the HTTP side then never waits behind the engine for Python's GIL. Use it on "
        "a GPU under heavy streaming load (watch sits:event_loop_lag_seconds); costs one extra "
        "process and a pipe hop per step (default off)",
    )
    p.add_argument(
        "--engine-step-timeout",
        type=positive_seconds,
        default=ENGINE_STEP_TIMEOUT_S,
        metavar="S",
        help="seconds one engine step may run before the engine counts as hung: open "
        "requests fail with 503 and the server exits with status 1 (default %(default)g, as vLLM's "
        "VLLM_ENGINE_ITERATION_TIMEOUT_S). Raise it for a large model on a CPU, where one "
        "prompt chunk of --max-num-batched-tokens may take longer. Between steps the loop "
        "must still turn within 10 s",
    )
    p.add_argument(
        "--engine-stall-floor",
        type=positive_seconds,
        default=None,
        metavar="S",
        help='/health answers 503 ("engine_stalled", the engine lives on) while one step has '
        "run past 10x this engine's slow steps and at least S seconds, so a load balancer "
        "stops sending work to a frozen engine long before --engine-step-timeout ends it "
        "(default: 5 on a GPU, 30 on a CPU, where a busy machine's steps can take 15-20 s)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=non_negative_number,
        default=20.0,
        help="seconds SIGTERM waits for in-flight requests before cutting them (default 20: "
        "with 2 s to write the cut streams' error events and 5 s for connections to close, "
        "the drain ends inside the usual 30 s before SIGKILL); a second SIGTERM cuts at once "
        "and exits 1",
    )
    p.add_argument(
        "--http",
        default="auto",
        choices=HTTP_CHOICES,
        help="uvicorn's HTTP protocol (default auto: httptools when installed, else h11)",
    )
    p.add_argument(
        "--loop",
        default="auto",
        choices=LOOP_CHOICES,
        help="the HTTP process's event loop (default auto: uvloop when installed, else asyncio's)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="log level of sits and uvicorn (default info)",
    )
    p.add_argument(
        "--precision-policy",
        default="manual",
        choices=("manual", "overload"),
        help="who switches the weights of --precision-switch: manual (default; the operator "
        "only, POST /v1/admin/precision) or overload (also the server: low precision once the "
        "overload state has been red for --precision-red-seconds, back to full precision once "
        "green for --precision-green-seconds; an operator's switch restarts that count)",
    )
    p.add_argument(
        "--precision-red-seconds",
        type=non_negative_number,
        default=None,
        metavar="S",
        help="seconds of red before the overload policy switches to low precision (default 5)",
    )
    p.add_argument(
        "--precision-green-seconds",
        type=non_negative_number,
        default=None,
        metavar="S",
        help="seconds of green before the overload policy switches back to full precision "
        "(default 30)",
    )
    add_fleet_args(p)
    p.set_defaults(func=run_serve)
    return p


def check_port_free(host: str, port: int) -> None:
    """Bind `port` on every address `host` resolves to, as uvicorn's asyncio server will
    (SO_REUSEADDR; IPv6 sockets IPv6-only; an address family the machine lacks is skipped),
    and release it at once: a busy port is then refused before the model loads.

    Raises:
        InvalidParameterError: the port is in use ("port"), or `host` does not resolve or
            cannot be bound ("host").
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidParameterError("host", f"cannot resolve host {host!r}: {exc}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:  # asyncio skips such a family too
                    continue
                if exc.errno == errno.EADDRINUSE:
                    raise InvalidParameterError(
                        "port",
                        f"port {port} on {host} is in use: stop what listens there or choose "
                        "another --port",
                    ) from None
                raise InvalidParameterError(
                    "host", f"cannot bind port {port} on {host}: {exc.strerror}"
                ) from None


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else --api-key-file, else $SITS_API_KEY, else None (an empty value means no
    key). Raises InvalidParameterError: an unreadable key file."""
    return resolve_secret(args, "api-key", API_KEY_ENV, environ)


def resolve_admin_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--admin-key, else --admin-key-file, else $SITS_ADMIN_KEY, else None (an empty value
    means no admin routes). Raises InvalidParameterError: an unreadable key file."""
    return resolve_secret(args, "admin-key", ADMIN_KEY_ENV, environ)


def engine_config_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """EngineConfig fields from the parsed flags, for checkpoint `model`."""
    kwargs = engine_kwargs(args)
    kwargs["model"] = model
    kwargs["served_model_name"] = served_names_arg(args)[0]
    return kwargs


def load_tenants_arg(path: str | None, api_key: str | None) -> TenantsConfig | None:
    """The tenants of `--tenants PATH` (None without it).

    Raises:
        TenantConfigError: the file is malformed (message: file, line, field).
        InvalidParameterError: an API key was given too (keys belong to the tenants).
    """
    from sits.core.errors import InvalidParameterError
    from sits.tenancy import load_tenants

    if path is None:
        return None
    if api_key is not None:
        raise InvalidParameterError(
            "api_key",
            f"--tenants and an API key (--api-key or ${API_KEY_ENV}) exclude each other: put "
            "the keys' SHA-256 hashes in the tenants file (`sits tenants hash-key -`)",
        )
    return load_tenants(path)


def audit_settings_arg(args: argparse.Namespace) -> Any:
    """The `AuditSettings` of the --audit-* flags (None without --audit-log).

    Raises:
        InvalidParameterError: a key or checkpoint flag without --audit-log, a checkpoint
            interval below 1, top logprobs out of range, or a bad key file (`load_key_file`:
            missing, empty, too short, open to other users).
    """
    from sits.obs.audit_keys import load_key_file
    from sits.obs.request_audit import AuditSettings

    if args.audit_log is None:
        for flag in ("audit_key_file", "audit_checkpoint_file"):
            if getattr(args, flag) is not None:
                raise InvalidParameterError(flag, f"--{flag.replace('_', '-')} needs --audit-log")
        return None
    if args.audit_checkpoint_interval < 1:
        raise InvalidParameterError(
            "audit_checkpoint_interval",
            f"--audit-checkpoint-interval must be >= 1, got {args.audit_checkpoint_interval}",
        )
    if not 0 <= args.audit_top_logprobs <= MAX_LOGPROBS:
        raise InvalidParameterError(
            "audit_top_logprobs",
            f"--audit-top-logprobs must be in [0, {MAX_LOGPROBS}], got {args.audit_top_logprobs}",
        )
    return AuditSettings(
        path=args.audit_log,
        top_logprobs=args.audit_top_logprobs,
        max_file_bytes=args.audit_max_file_bytes,
        store_input=args.audit_store_input,
        key=None if args.audit_key_file is None else load_key_file(args.audit_key_file),
        checkpoint_path=args.audit_checkpoint_file,
        checkpoint_every_records=args.audit_checkpoint_interval,
    )


def tracing_settings_arg(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    """The `TracingSettings` of --otlp-traces-endpoint / --trace-sample-ratio and the OTEL_*
    variables (None: tracing off; see `sits.obs.tracing.resolve_tracing`).

    Raises:
        InvalidParameterError: a bad URL or ratio.
    """
    from sits.obs.tracing import resolve_tracing

    return resolve_tracing(args.otlp_traces_endpoint, args.trace_sample_ratio, environ)


def precision_policy_arg(args: argparse.Namespace) -> Any:
    """The `PrecisionPolicySettings` of the --precision-* flags.

    Raises:
        InvalidParameterError: `--precision-policy overload` without `--precision-switch`, or
            a `--precision-*-seconds` flag without `--precision-policy overload`.
    """
    from sits.admission.precision_policy import PrecisionPolicyKind, PrecisionPolicySettings

    policy = PrecisionPolicyKind(args.precision_policy)
    if policy is PrecisionPolicyKind.OVERLOAD and args.precision_switch is None:
        raise InvalidParameterError(
            "precision_policy",
            "--precision-policy overload switches between two weight sets: it needs "
            "--precision-switch fp8 or --precision-switch int4",
        )
    timed = [
        flag
        for flag, value in (
            ("--precision-red-seconds", args.precision_red_seconds),
            ("--precision-green-seconds", args.precision_green_seconds),
        )
        if value is not None
    ]
    if timed and policy is not PrecisionPolicyKind.OVERLOAD:
        raise InvalidParameterError(
            "precision_policy",
            f"{' and '.join(timed)} only apply with --precision-policy overload",
        )
    red_s = 5.0 if args.precision_red_seconds is None else args.precision_red_seconds
    green_s = 30.0 if args.precision_green_seconds is None else args.precision_green_seconds
    return PrecisionPolicySettings(policy=policy, red_s=red_s, green_s=green_s)


def run_serve(args: argparse.Namespace) -> int:
    """Run `sits serve` with parsed flags.

    Returns:
        The process exit code: 0 after a SIGTERM drain, 1 after engine death, 2 for a bad
        model, tenants file or configuration, or a port in use.
    """
    from sits.config import EngineConfig
    from sits.core.errors import SitsError
    from sits.demo import DEMO_MODEL_NAME, TRAINED_DESCRIPTION, demo_info, ensure_demo_model
    from sits.obs.loop_lag import apply_switch_interval
    from sits.server.app import build_app
    from sits.server.context import ServerSettings
    from sits.server.http_impl import loop_factory, resolve_http
    from sits.server.uvicorn_server import run_app

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sits").setLevel(args.log_level.upper())
    log = logging.getLogger("sits.serve")
    if args.model and args.model_tag and args.model != args.model_tag:
        print("error: give the model once (positional MODEL or --model)", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        api_key = resolve_api_key(args, env_values(API_KEY_ENV))
        admin_key = resolve_admin_key(args, env_values(ADMIN_KEY_ENV))
        router_key = resolve_router_key(args, env_values(ROUTER_KEY_ENV))
        tenants = load_tenants_arg(args.tenants, api_key)
        registration = registration_arg(args, router_key)
        fault_injection = fault_injection_arg(args)
        precision_policy = precision_policy_arg(args)
        tracing = tracing_settings_arg(args, env_values(*TRACING_ENVS))
        audit = audit_settings_arg(args)  # a bad key file is refused before the model loads
        chat_template = chat_template_arg(args.chat_template)
        cors = cors_arg(args)
        uvicorn_options = uvicorn_kwargs_arg(args)
        max_logprobs = max_logprobs_arg(args.max_logprobs)
        apply_switch_interval(args.gil_switch_interval_ms)
        # A missing --http/--loop implementation and a busy port are refused here, before the
        # model loads.
        http = resolve_http(args.http)
        loop_factory(args.loop)
        check_port_free(args.host, args.port)
    except SitsError as exc:
        from sits.tenancy.loader import TenantConfigError, check_tenants

        errors = check_tenants(args.tenants) if isinstance(exc, TenantConfigError) else []
        for error in errors or [exc]:  # every error of a bad tenants file, as `tenants check`
            print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if tenants is not None:
        log.info("tenants from %s: %s", args.tenants, ", ".join(tenants.ids))
    model = args.model or args.model_tag
    is_demo = model is None
    if is_demo:
        log.info("no --model given: serving the built-in demo model %s", DEMO_MODEL_NAME)
        model = ensure_demo_model()
    info = demo_info(model)
    random_weights = bool(info.get("random_weights", False))
    kwargs = engine_config_kwargs(args, model)
    if is_demo and kwargs["served_model_name"] is None:
        kwargs["served_model_name"] = DEMO_MODEL_NAME
    try:
        from sits.engine.async_llm import AsyncLLM
        from sits.engine.builder import tenant_policies_of
        from sits.models.loader import resolve_model_path

        config = EngineConfig(**kwargs)
        model_dir = resolve_model_path(config.model, **config.hub_options)
        sampling_defaults = sampling_defaults_arg(args.generation_config, model_dir)
        check_tensor_parallel_fit(config)  # before any worker process starts
        engine = AsyncLLM(
            config,
            engine_process=args.engine_process,
            step_timeout_s=args.engine_step_timeout,
            stall_floor_s=args.engine_stall_floor,
            tenant_policies=tenant_policies_of(tenants),
            expert_freeze_after=args.expert_freeze_after,
            restore_frozen_experts=args.restore_frozen_experts,
        )
        if chat_template is not None:
            engine.tokenizer.use_chat_template(chat_template)
    except SitsError as exc:
        print(f"error: {flag_prefix(exc, args)}{exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    description = info.get("description") or (TRAINED_DESCRIPTION if is_demo else None)
    if random_weights:
        log.warning("%s", description)
    settings = ServerSettings(
        served_model_name=config.model_name,
        api_key=api_key,
        model_root=model,
        random_weights=random_weights,
        model_description=str(description) if description else None,
        shutdown_timeout_s=args.shutdown_timeout,
        tenants=tenants,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        audit=audit,
        admin_key=admin_key,
        tracing=tracing,
        gpu_price_per_hour=args.gpu_price_per_hour,
        router_key=router_key,
        registration=registration,
        fault_injection=fault_injection,
        precision_policy=precision_policy,
        served_model_aliases=served_names_arg(args)[1],
        sampling_defaults=sampling_defaults,
        max_logprobs=max_logprobs,
        log_requests=args.enable_log_requests and not args.disable_log_requests,
        max_log_len=args.max_log_len,
        cors=cors,
    )
    if sampling_defaults:
        log.info("sampling defaults from the generation config: %s", sampling_defaults)
    app = build_app(engine, settings)
    uvicorn_log_level = args.uvicorn_log_level or args.log_level
    return run_app(app, args.host, args.port, uvicorn_log_level, http, args.loop, **uvicorn_options)


def main(argv: list[str] | None = None) -> int:
    """Run `serve` alone (for `python -m sits.cli.serve`)."""
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
