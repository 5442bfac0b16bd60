"""`sits` command line: `sits serve | generate ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from sits.core.errors import InvalidParameterError, SitsError


def build_parser() -> argparse.ArgumentParser:
    """The `sits` argument parser with every subcommand."""
    from sits import __version__
    from sits.cli.audit import add_audit_parser
    from sits.cli.bench import add_bench_parser
    from sits.cli.generate import add_generate_parser
    from sits.cli.serve import add_serve_parser
    from sits.cli.tenants import add_tenants_parser

    parser = argparse.ArgumentParser(prog="sits", description="multi-tenant LLM serving")
    parser.add_argument("--version", action="version", version=f"sits {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(subparsers)
    add_generate_parser(subparsers)
    add_tenants_parser(subparsers)
    add_bench_parser(subparsers)
    add_audit_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SitsError as exc:
        print(f"error: {_flag_of(exc, args)}{exc}", file=sys.stderr)
        return 2


def _flag_of(exc: SitsError, args: argparse.Namespace) -> str:
    """ "argument --NAME: " when `exc` is about a value the command line gave (its param is one
    of the parsed options, spelled with dashes), as argparse names the flag of its own errors;
    else ""."""
    param = getattr(exc, "param", None) if isinstance(exc, InvalidParameterError) else None
    if not param or not hasattr(args, param) or getattr(args, param) is None:
        return ""
    return f"argument --{param.replace('_', '-')}: "


if __name__ == "__main__":
    sys.exit(main())
