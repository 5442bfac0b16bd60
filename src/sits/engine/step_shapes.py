"""Recording each engine step's shape, to replay the same steps offline under a profiler.

With `SITS_STEP_SHAPES_FILE=PATH` in the environment of a process that builds an engine (for
example `sits serve`; with `--engine-process` the engine process inherits it), every step
appends one JSON line to PATH:

    {"step": 1234, "runner_ms": 38.71, "reqs": [[576, 1], [576, 1], ..., [0, 512], [212, 300]]}

`reqs` lists the step's scheduled requests in batch order as [start_position, num_tokens]
(tokens already in the KV cache, tokens computed now): a decode is [context, 1], a prompt chunk
[cached, chunk]. `runner_ms` is the model runner's wall time of the step. Lines are written as
they come (line-buffered), so a server stopped by a signal leaves whole lines.

`bench/profile_step.py --replay PATH ...` rebuilds such steps with random tokens and times them
kernel by kernel, so the steps a server ran in two configurations (e.g. QoS and FCFS) can be
compared on the device alone, without the host and the HTTP side around them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TextIO

from sits.config import STEP_SHAPES_ENV
from sits.core.plan import StepPlan


class StepShapeRecorder:
    """Appends one JSON line per step to a file (module docstring).

    Args:
        path: the file (appended to; created if missing).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO | None = open(path, "a", buffering=1)  # noqa: SIM115 - kept open
        self.num_steps = 0

    def record(self, plan: StepPlan, runner_s: float) -> None:
        """Write the step's line (`runner_s`: the runner's wall seconds for the step)."""
        if self._file is None:
            return
        self.num_steps += 1
        reqs = [[sr.start_position, sr.num_tokens] for sr in plan.scheduled]
        line = {"step": self.num_steps, "runner_ms": round(runner_s * 1e3, 3), "reqs": reqs}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def recorder_from_env(environ: Mapping[str, str]) -> StepShapeRecorder | None:
    """A recorder writing to `environ[STEP_SHAPES_ENV]`, or None when it is unset or empty."""
    path = environ.get(STEP_SHAPES_ENV)
    return StepShapeRecorder(path) if path else None


def read_step_shapes(path: str) -> list[dict]:
    """The steps of a recorded file, in order (each {"step", "runner_ms", "reqs"}).

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not such a JSON object.
    """
    steps = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            step = json.loads(line)
            if not isinstance(step, dict) or not isinstance(step.get("reqs"), list):
                raise ValueError(f"{path}:{number}: not a step shape line")
            steps.append(step)
    return steps
