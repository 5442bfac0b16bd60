"""`sits` command line: `sits serve | generate ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from sits.cli.flags import flag_prefix
from sits.core.errors import SitsError


def build_parser() -> argparse.ArgumentParser:
    """The `sits` argument parser with every subcommand."""
    from sits import __version__
    from sits.cli.audit import add_audit_parser
    from sits.cli.bench import add_bench_parser
    from sits.cli.generate import add_generate_parser
    from sits.cli.router import add_router_parser
    from sits.cli.serve import add_serve_parser
    from sits.cli.tenants import add_tenants_parser

    parser = argparse.ArgumentParser(prog="sits", description="multi-tenant LLM serving")
    parser.add_argument("--version", action="version", version=f"sits {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    add_generate_parser(subparsers)
    add_router_parser(subparsers)
    add_tenants_parser(subparsers)
    add_bench_parser(subparsers)
    add_audit_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per heartbeat or request
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SitsError as exc:
        print(f"error: {flag_prefix(exc, args)}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
