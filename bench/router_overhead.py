"""The fleet router's overhead from a checkout: `python bench/router_overhead.py [flags]`.

Starts N replicas (paced fakes by default, or `sits serve` with `--replicas-kind sits`) and
`sits router` in front of them on loopback, measures the router's added TTFT and its throughput
against direct connections to the same replicas, then kills a replica under a stream load and
counts the requests lost: `sits.bench.router_overhead`.
"""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.router_overhead"))
