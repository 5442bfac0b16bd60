"""The fleet router's overhead from a checkout: `python bench/router_overhead.py [flags]`.

Starts N replicas (paced fakes by default, or `sits serve` with `--replicas-kind sits`) and
`sits router` in front of them on loopback, measures the router's added TTFT and its throughput
against direct connections to the same replicas, then kills a replica under a stream load and
counts the requests lost. The driver lives in `sits.bench.router_overhead`; this file only makes
a source checkout's `src/` importable when sits is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    """Run the benchmark with this process's arguments; returns its exit code."""
    try:
        import sits  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from sits.bench.router_overhead import main as bench_main

    return bench_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
