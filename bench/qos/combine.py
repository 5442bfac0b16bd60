"""Single-mode `sits bench qos` results combined into one QoS / FCFS comparison:
`python bench/qos/combine.py QOS_JSON FCFS_JSON [--result-json OUT]`
(`sits.bench.qos_combine`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _checkout
from _checkout import run_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.qos_combine"))
