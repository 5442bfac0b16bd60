"""`sits bench qos` from a checkout: `python bench/qos_compare.py --model M --tenants T ...`.

Starts `sits serve` with QoS (`--tenants`) and plain FCFS, runs the same tenant mix against
each and prints per-tenant SLO attainment side by side with the output throughput ratio. The
driver lives in `sits.bench.qos_compare` (also `sits bench qos`); this file only makes a source
checkout's `src/` importable when sits is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    """Run the comparison with this process's arguments; returns its exit code."""
    try:
        import sits  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from sits.bench.qos_compare import main as qos_main

    return qos_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
