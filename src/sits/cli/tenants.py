"""`sits tenants hash-key KEY | -` and `sits tenants check FILE`: tenant setup helpers.

`hash-key` prints the SHA-256 hex of an API key, the value to put in `api_key_sha256` (keys are
never stored in clear). Pass `-` to read the key from stdin (keeps it out of shell history and
process lists); one trailing newline (LF or CRLF) is dropped. `check` validates a tenants.toml
and prints one line per tenant, or every error it finds (each with its line and field) on
stderr and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from sits.core.errors import InvalidParameterError

EXIT_BAD_FILE = 2  # as `sits serve --tenants` with a malformed file


def add_tenants_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `sits tenants` with its `hash-key` and `check` subcommands."""
    p = subparsers.add_parser("tenants", help="tenant configuration helpers")
    sub = p.add_subparsers(dest="tenants_command", required=True)
    h = sub.add_parser("hash-key", help="print the SHA-256 hex of an API key")
    h.add_argument("key", help="the API key, or '-' to read it from stdin (recommended)")
    h.set_defaults(func=run_hash_key)
    c = sub.add_parser("check", help="validate a tenants.toml file")
    c.add_argument("path", help="the tenants.toml file")
    c.set_defaults(func=run_check)


def _read_key(arg: str) -> str:
    key = sys.stdin.read() if arg == "-" else arg
    if key.endswith("\n"):
        key = key[:-1]
        if key.endswith("\r"):
            key = key[:-1]
    if not key:
        raise InvalidParameterError("key", "the API key is empty")
    return key


def run_hash_key(args: argparse.Namespace) -> int:
    """Print the key's SHA-256 hex.

    Raises:
        InvalidParameterError: the key is empty.
    """
    from sits.tenancy.keys import hash_api_key

    print(hash_api_key(_read_key(args.key)))
    return 0


def run_check(args: argparse.Namespace) -> int:
    """Print each tenant's summary (0), or every error of the file on stderr (2).

    Errors are `TenantConfigError` messages: file, line, tenant and field.
    """
    from sits.tenancy.loader import check_tenants, load_tenants

    errors = check_tenants(args.path)
    if errors:
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        print(f"{len(errors)} error(s) in {args.path}", file=sys.stderr)
        return EXIT_BAD_FILE
    tenants = load_tenants(args.path)
    for t in tenants:
        print(
            f"{t.id}: tier={t.tier.value} reserved_kv_fraction={t.reserved_kv_fraction:g} "
            f"keys={len(t.api_key_sha256)}"
        )
    anon = tenants.anonymous_tenant_id
    print(f"{len(tenants)} tenant(s) OK; anonymous tenant: {anon or 'none (auth required)'}")
    return 0
