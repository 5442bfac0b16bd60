"""`sits bench qos` from a checkout: `python bench/qos_compare.py --model M --tenants T ...`.

The comparison (the same tenant mix against `sits serve` with and without QoS) is
`sits.bench.qos_compare`.
"""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.qos_compare"))
