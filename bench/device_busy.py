"""Is the device ever idle between steps? `python bench/device_busy.py [flags]`
(`sits.bench.device_busy`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.device_busy"))
