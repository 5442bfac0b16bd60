"""The kernel's accept queues of listening sockets, sampled while a benchmark runs:
`python3 bench/qos/listen_queue.py --out FILE [flags]` (`sits.bench.listen_queue`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _checkout
from _checkout import run_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_main("sits.bench.listen_queue"))
