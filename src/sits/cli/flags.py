"""Naming the command-line flag behind a refused value, as argparse names the flag of its own
errors ("argument --client-procs: ..."), and the argparse types of `sits serve`'s numbers
(checked while parsing, before any model work)."""

from __future__ import annotations

import argparse
import math

from sits.core.errors import InvalidParameterError, SitsError


def flag_prefix(exc: SitsError, args: argparse.Namespace) -> str:
    """ "argument --NAME: " when `exc` is about a value the command line gave (its param is one
    of the parsed options, spelled with dashes); else ""."""
    param = getattr(exc, "param", None) if isinstance(exc, InvalidParameterError) else None
    if not param or not hasattr(args, param) or getattr(args, param) is None:
        return ""
    return f"argument --{param.replace('_', '-')}: "


def port_number(value: str) -> int:
    """argparse type of --port: an integer in [0, 65535] (checked before the model loads)."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {port}")
    return port


def non_negative_number(value: str) -> float:
    """argparse type of --gpu-price-per-hour, --shutdown-timeout and --precision-*-seconds: a
    finite number >= 0."""
    try:
        price = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not (math.isfinite(price) and price >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {value!r}")
    return price


def positive_seconds(value: str) -> float:
    """argparse type of --engine-step-timeout: a finite number of seconds > 0."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {value!r}")
    return seconds
