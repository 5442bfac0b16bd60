"""`sits serve`: the OpenAI-compatible HTTP server (flag names follow `vllm serve`).

`add_serve_parser(subparsers)` declares the subcommand; `run_serve(args)` loads the engine,
builds the app and serves until SIGTERM (exit 0 after the drain) or engine death (exit 1).
With no model the built-in demo model `sits-demo` is served (`sits.demo`). The API key comes
from --api-key or else the SITS_API_KEY environment variable, read here at run time.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from sits.cli.engine_args import add_engine_args, engine_kwargs

API_KEY_ENV = "SITS_API_KEY"
EXIT_BAD_CONFIG = 2


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API. With no model, serve "
        "the built-in demo model 'sits-demo' (made locally on first use, no download).",
    )
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="as --model")
    add_engine_args(p, model_required=False)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="name clients use as `model`")
    p.add_argument("--api-key", default=None, help=f"require this bearer key (also ${API_KEY_ENV})")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before cutting them (default 30)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
    )
    p.set_defaults(func=run_serve)
    return p


def resolve_api_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--api-key, else $SITS_API_KEY, else None (an empty value means no key)."""
    key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV)
    return key or None


def engine_config_kwargs(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """EngineConfig fields from the parsed flags, for checkpoint `model`."""
    kwargs = engine_kwargs(args)
    kwargs["model"] = model
    kwargs["served_model_name"] = args.served_model_name
    return kwargs


def run_serve(args: argparse.Namespace) -> int:
    """Run `sits serve` with parsed flags.

    Returns:
        The process exit code: 0 after a SIGTERM drain, 1 after engine death, 2 for a bad
        model or configuration.
    """
    from sits.config import EngineConfig
    from sits.core.errors import SitsError
    from sits.demo import DEMO_MODEL_NAME, TRAINED_DESCRIPTION, demo_info, ensure_demo_model
    from sits.server.app import build_app
    from sits.server.context import ServerSettings
    from sits.server.runner import run_app

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("sits").setLevel(args.log_level.upper())
    log = logging.getLogger("sits.serve")
    if args.model and args.model_tag and args.model != args.model_tag:
        print("error: give the model once (positional MODEL or --model)", file=sys.stderr)
        return EXIT_BAD_CONFIG
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

        config = EngineConfig(**kwargs)
        engine = AsyncLLM(config)
    except SitsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    description = info.get("description") or (TRAINED_DESCRIPTION if is_demo else None)
    if random_weights:
        log.warning("%s", description)
    settings = ServerSettings(
        served_model_name=config.model_name,
        api_key=resolve_api_key(args, os.environ),
        model_root=model,
        random_weights=random_weights,
        model_description=str(description) if description else None,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    app = build_app(engine, settings)
    return run_app(app, args.host, args.port, log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    """Run `serve` alone (for `python -m sits.cli.serve`)."""
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
