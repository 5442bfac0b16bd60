"""`sits router`: one OpenAI endpoint in front of many `sits serve` replicas.

`add_router_parser(subparsers)` declares the subcommand; `run_router(args)` builds
`RouterSettings` (a bad value exits 2 naming the flag), then serves `sits.router.app` under
uvicorn until SIGTERM or SIGINT (uvicorn's graceful stop: open streams finish). The router key
comes from --router-key, else $SITS_ROUTER_KEY (read here, at run time).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from sits.cli.key_flags import add_secret_args, resolve_secret
from sits.config import ROUTER_KEY_ENV, env_values
from sits.router.canary import CanaryConfig
from sits.router.settings import DEFAULT_FALLBACK_P99_S, DEFAULT_LOAD_BOUND, DEFAULT_MAX_ATTEMPTS
from sits.server.http_impl import HTTP_CHOICES, LOOP_CHOICES

EXIT_BAD_CONFIG = 2


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `router` subcommand to an argparse subparsers object; returns its parser."""
    defaults = CanaryConfig()
    p = subparsers.add_parser(
        "router",
        help="route OpenAI requests over many sits serve replicas",
        description="One OpenAI-compatible endpoint in front of many `sits serve` replicas: "
        "registry with heartbeats, prefix/load-aware routing, per-replica circuit breakers, "
        "failover, predicted-P99 fallback, an automatic canary and fleet-wide tenant limits.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--replica", action="append", default=[], metavar="URL",
        help="a static primary replica (repeatable); replicas may also register themselves "
        "with `sits serve --register-with URL`",
    )  # fmt: skip
    p.add_argument(
        "--fallback", action="append", default=[], metavar="URL",
        help="a fallback replica (another zone, a smaller model; repeatable): serves requests "
        "when no primary replica is predicted under the TTFT limit or none is left",
    )  # fmt: skip
    p.add_argument(
        "--canary", action="append", default=[], metavar="URL",
        help="a static canary replica (repeatable); registered replicas with "
        "--version-label canary join them",
    )  # fmt: skip
    p.add_argument(
        "--tenants", default=None, metavar="FILE",
        help="tenants.toml (the format of sits serve --tenants): authenticate clients and apply "
        "their request and token rate limits once for the whole fleet; needs --router-key",
    )  # fmt: skip
    add_secret_args(
        p, "router-key", ROUTER_KEY_ENV,
        "key of registration, heartbeats and /v1/router/*; replicas trust the tenant the "
        "router forwards only from this key",
    )  # fmt: skip
    p.add_argument(
        "--fallback-p99-ms", type=float, default=DEFAULT_FALLBACK_P99_S * 1000, metavar="MS",
        help="send a request to the fallback pool when every primary replica's predicted TTFT "
        "P99 is above this (default %(default)g; a tenant's ttft_ms takes its place)",
    )  # fmt: skip
    p.add_argument(
        "--load-bound", type=float, default=DEFAULT_LOAD_BOUND, metavar="B",
        help="how many requests more (waiting + running + KV use + overload) the "
        "prefix-affine replica may have than the least loaded one (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS, metavar="N",
        help="replicas tried per request before 503 (default %(default)d)",
    )  # fmt: skip
    p.add_argument(
        "--first-byte-timeout", type=float, default=300.0, metavar="S",
        help="seconds an attempt waits for its first response byte before another replica is "
        "tried (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout", type=float, default=600.0, metavar="S",
        help="seconds a request may take in all, retries included (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--probe-interval", type=float, default=1.0, metavar="S",
        help="seconds between /health probes of each replica (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--breaker-cooldown", type=float, default=10.0, metavar="S",
        help="seconds an open breaker refuses a replica before a half-open probe "
        "(default %(default)g); it opens at >= 30 %% failed requests over 60 s (10 or more) "
        "or 5 failures in a row",
    )  # fmt: skip
    p.add_argument(
        "--canary-weight", type=float, default=defaults.initial_weight, metavar="W",
        help="share of requests a new canary starts with, 0..1 (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--canary-steps", default=",".join(f"{s:g}" for s in defaults.steps), metavar="W,W,...",
        help="weights a healthy canary steps through (default %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--canary-window", type=float, default=defaults.window_s, metavar="S",
        help="sliding window of the canary comparison, seconds (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--canary-min-samples", type=int, default=defaults.min_samples, metavar="N",
        help="requests per side in the window before a decision (default %(default)d)",
    )  # fmt: skip
    p.add_argument(
        "--canary-step-hold", type=float, default=defaults.step_hold_s, metavar="S",
        help="seconds at one weight before stepping up (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--canary-max-ttft-ratio", type=float, default=defaults.max_ttft_p95_ratio, metavar="R",
        help="roll back when canary P95 TTFT > ratio x stable's (+ slack) (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--canary-max-tpot-ratio", type=float, default=defaults.max_tpot_p95_ratio, metavar="R",
        help="roll back when canary P95 TPOT > ratio x stable's (+ slack) (default %(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--canary-max-error-delta", type=float, default=defaults.max_error_rate_delta, metavar="D",
        help="roll back when the canary's error rate exceeds stable's by this (default "
        "%(default)g)",
    )  # fmt: skip
    p.add_argument(
        "--http", default="auto", choices=HTTP_CHOICES,
        help="uvicorn's HTTP protocol (default auto: httptools when installed, else h11)",
    )  # fmt: skip
    p.add_argument(
        "--loop", default="auto", choices=LOOP_CHOICES,
        help="the event loop (default auto: uvloop when installed, else asyncio's)",
    )  # fmt: skip
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
        help="log level of sits and uvicorn (default info)",
    )  # fmt: skip
    p.set_defaults(func=run_router)
    return p


def router_settings(args: argparse.Namespace, environ: dict[str, str] | Any) -> Any:
    """The `RouterSettings` of the parsed flags.

    Raises:
        InvalidParameterError: a bad value (its parameter names the setting).
        TenantConfigError: a malformed tenants file.
    """
    from sits.admission import BreakerConfig
    from sits.core.errors import InvalidParameterError
    from sits.router.settings import RouterSettings
    from sits.tenancy import load_tenants

    try:
        steps = tuple(float(s) for s in args.canary_steps.split(",") if s.strip())
    except ValueError:
        raise InvalidParameterError(
            "canary_steps", f"not a list of numbers: {args.canary_steps!r}"
        ) from None
    canary = CanaryConfig(
        initial_weight=args.canary_weight,
        steps=steps,
        window_s=args.canary_window,
        min_samples=args.canary_min_samples,
        step_hold_s=args.canary_step_hold,
        max_ttft_p95_ratio=args.canary_max_ttft_ratio,
        max_tpot_p95_ratio=args.canary_max_tpot_ratio,
        max_error_rate_delta=args.canary_max_error_delta,
    )
    key = resolve_secret(args, "router-key", ROUTER_KEY_ENV, environ)
    return RouterSettings(
        router_key=key,
        replicas=tuple(args.replica),
        fallbacks=tuple(args.fallback),
        canaries=tuple(args.canary),
        tenants=load_tenants(args.tenants) if args.tenants else None,
        fallback_p99_s=args.fallback_p99_ms / 1000,
        load_bound=args.load_bound,
        max_attempts=args.max_attempts,
        first_byte_timeout_s=args.first_byte_timeout,
        request_timeout_s=args.request_timeout,
        probe_interval_s=args.probe_interval,
        breaker=BreakerConfig(open_s=args.breaker_cooldown),
        canary=canary,
    )


def run_router(args: argparse.Namespace) -> int:
    """Run `sits router` with parsed flags; returns the exit code (2: a bad flag or file)."""
    import asyncio

    import uvicorn

    from sits.core.errors import SitsError
    from sits.router.app import build_router_app
    from sits.server.http_impl import loop_factory, resolve_http

    logging.getLogger("sits").setLevel(args.log_level.upper())
    try:
        settings = router_settings(args, env_values(ROUTER_KEY_ENV))
        http = resolve_http(args.http)
        factory = loop_factory(args.loop)
    except SitsError as exc:
        param = getattr(exc, "param", None)
        flag = f"--{param.replace('_', '-')}: " if param else ""
        print(f"error: {flag}{exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if not settings.replicas and not settings.router_key:
        print(
            "error: give --replica URL, or --router-key so that replicas can register",
            file=sys.stderr,
        )
        return EXIT_BAD_CONFIG
    app = build_router_app(settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=30,
        access_log=False,
        http=http,
    )
    logging.getLogger(__name__).info(
        "HTTP: %s on %s", http, "uvloop" if factory else "asyncio's event loop"
    )
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(uvicorn.Server(config).serve())
    return 0
