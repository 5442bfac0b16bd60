"""Naming the command-line flag behind a refused value, as argparse names the flag of its own
errors ("argument --client-procs: ...")."""

from __future__ import annotations

import argparse

from sits.core.errors import InvalidParameterError, SitsError


def flag_prefix(exc: SitsError, args: argparse.Namespace) -> str:
    """ "argument --NAME: " when `exc` is about a value the command line gave (its param is one
    of the parsed options, spelled with dashes); else ""."""
    param = getattr(exc, "param", None) if isinstance(exc, InvalidParameterError) else None
    if not param or not hasattr(args, param) or getattr(args, param) is None:
        return ""
    return f"argument --{param.replace('_', '-')}: "
