"""Bearer keys of the command line without putting them on it: `--X`, `--X-file` or `$ENV`.

A key given as `--api-key K` shows in `ps`, `/proc/PID/cmdline` and shell history to every
user of the machine. Each key flag therefore has a `--X-file PATH` twin (the file's contents,
trailing whitespace and newline stripped: what `echo K > PATH` or a Kubernetes secret volume
writes) and an environment variable; the help of each says so. Order: the flag, else the
file, else the environment; an empty value means no key, as before.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from sits.core.errors import InvalidParameterError


def add_secret_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    env: str,
    help_text: str,
    metavar: str = "KEY",
) -> None:
    """Add `--{flag}` and `--{flag}-file` (mutually exclusive) to `parser`.

    Args:
        flag: the option's name without dashes, e.g. "api-key".
        env: the environment variable read when neither is given.
        help_text: what the key does; the help adds where else it can come from.
    """
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        f"--{flag}",
        default=None,
        metavar=metavar,
        help=f"{help_text}. Shows in `ps` to every user of the machine: prefer "
        f"--{flag}-file or ${env}",
    )
    group.add_argument(
        f"--{flag}-file",
        default=None,
        metavar="PATH",
        help=f"read --{flag} from this file (trailing whitespace stripped)",
    )


def resolve_secret(
    args: argparse.Namespace, flag: str, env: str, environ: Mapping[str, str]
) -> str | None:
    """The key of `--{flag}`, else of `--{flag}-file`, else $env; None when none is set or
    the value is empty.

    Raises:
        InvalidParameterError: the file cannot be read (its param is `{flag}_file`).
    """
    attr = flag.replace("-", "_")
    value = getattr(args, attr, None)
    path = getattr(args, f"{attr}_file", None)
    if value is None and path is not None:
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as file:
                value = file.read().rstrip()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidParameterError(
                f"{attr}_file", f"cannot read --{flag}-file {path}: {exc}"
            ) from None
    if value is None:
        value = environ.get(env)
    return value or None
