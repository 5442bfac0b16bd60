"""`sits bench serve` from a checkout: `python bench/serve_bench.py --base-url URL ...`.

The benchmark lives in `sits.bench` (also `sits bench serve` and `python -m sits.bench.serve`);
this file only makes a source checkout's `src/` importable when sits is not installed, so the
client runs on a machine that has just httpx (it needs no torch, no server packages).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    """Run the benchmark with this process's arguments; returns its exit code."""
    try:
        import sits  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from sits.bench.serve import main as serve_main

    return serve_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
