"""A guaranteed tenant's TTFT under a flood of refused (429) requests:
`python bench/flood.py [flags]` (`sits.bench.flood`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.flood"))
