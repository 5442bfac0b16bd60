"""QoS vs FCFS on the CPU with a modelled device: `python bench/qos_sim.py [flags]`
(`sits.bench.qos_sim`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.qos_sim"))
