"""The HTTP server's event-loop lag, engine in a thread vs its own process:
`python bench/loop_lag.py [flags]` (`sits.bench.loop_lag`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.loop_lag"))
