"""A calibrated copy of a `--tenants-mix` file from a measured capacity (issue 6):
`python bench/qos/calibrate.py CAPACITY_JSON MIX_TOML OUT_TOML [flags]`
(`sits.bench.qos_calibrate`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _checkout
from _checkout import run_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.qos_calibrate"))
