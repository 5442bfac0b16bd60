"""What an engine step costs by its shape: `python bench/step_costs.py [flags]`
(`sits.bench.step_costs`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.step_costs"))
