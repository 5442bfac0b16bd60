"""`sits` command line: `sits serve | generate ...`.

An unknown flag is refused with the usage of the subcommand it was given to (`sits serve:
error: unrecognized arguments ...`), as `vllm serve` does.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

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


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> Any:
    """Parse `argv`; an unknown flag is refused by the subcommand that was given (its usage
    and "unrecognized arguments", exit 2), not by the top-level parser, whose usage would not
    show the subcommand's flags."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        _innermost_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def _innermost_parser(parser: argparse.ArgumentParser, args: Any) -> argparse.ArgumentParser:
    """The (sub)parser of the deepest subcommand `args` names."""
    for action in parser._actions:  # argparse keeps its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _innermost_parser(chosen, args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per heartbeat or request
    args = parse_command_line(build_parser(), argv)
    try:
        return int(args.func(args) or 0)
    except SitsError as exc:
        print(f"error: {flag_prefix(exc, args)}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
