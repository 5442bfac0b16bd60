"""The CUDA kernels of decode, prefill, mixed and replayed steps:
`python bench/profile_step.py [flags]` (`sits.bench.profile_step`)."""

from __future__ import annotations

import sys

from _checkout import run_main

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.profile_step"))
