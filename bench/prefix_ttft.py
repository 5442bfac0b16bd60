"""TTFT of requests sharing a long prompt, prefix caching on and off:
`python bench/prefix_ttft.py [flags]` (`sits.bench.prefix_ttft`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.prefix_ttft"))
