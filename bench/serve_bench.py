"""`sits bench serve` from a checkout: `python bench/serve_bench.py --base-url URL ...`.

The benchmark is `sits.bench.serve` (also `sits bench serve`); it needs httpx, not torch or the
server packages, so the client runs on any machine with a checkout.
"""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.serve"))
