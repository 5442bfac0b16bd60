"""Tuned launch configs keyed by the number of rows M, as the GEMM tuners write them.

A table file is JSON `{"M": entry, ...}` (`bench/kernels/*_tune.py`); a call with M rows takes
the entry of the smallest key >= M, or the largest key's past all of them. Files are read once
per path (cached; a missing file is an empty table).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Config = TypeVar("Config")


@functools.lru_cache(maxsize=128)
def _read(path: Path) -> tuple[tuple[int, dict], ...]:
    if not path.is_file():
        return ()
    entries = json.loads(path.read_text())
    return tuple(sorted((int(m), entry) for m, entry in entries.items()))


def load_table(path: Path, parse: Callable[[dict], Config]) -> tuple[tuple[int, Config], ...]:
    """The (M, config) entries of a tuned file sorted by M; () when there is no file.

    Raises:
        ValueError (json.JSONDecodeError): the file is not JSON; what `parse` raises for an
            entry it cannot read.
    """
    return tuple((rows, parse(entry)) for rows, entry in _read(path))


def pick(entries: tuple[tuple[int, Config], ...], num_rows: int) -> Config | None:
    """The entry for M = num_rows (module docstring); None for an empty table."""
    for key, config in entries:
        if key >= num_rows:
            return config
    return entries[-1][1] if entries else None
