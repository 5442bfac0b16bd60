"""Throughput with 0 % and 10 % of the requests under a JSON schema, in one run:
`python bench/structured_cost.py [flags]` (`sits.bench.structured_cost`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.structured_cost"))
