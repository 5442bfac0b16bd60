"""KV tiers, recompute-only vs host tier on one burst: `python bench/kv_tiers.py [flags]`
(`sits.bench.kv_tiers`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.kv_tiers"))
