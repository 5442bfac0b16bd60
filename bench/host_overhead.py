"""Host cost of an engine step outside the forward, by part: `python bench/host_overhead.py`
(`sits.bench.host_overhead`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.host_overhead"))
