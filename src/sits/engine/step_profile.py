"""Profiling a window of a running engine's steps with torch.profiler, by environment variable.

`SITS_PROFILE_STEPS=START:COUNT` (e.g. `2000:20`) makes an engine profile its steps START to
START + COUNT - 1 (1-based, counted by the engine) and then write the profile's table
(`key_averages`, sorted by device time, or by CPU time without a GPU) to
`SITS_PROFILE_FILE` (default `sits-profile-<pid>.txt` in the working directory). It sees
what a live server's steps do on the device and on the host, including what the offline
replays (`bench/profile_step.py --replay`) leave out: sampling, input preparation, and gaps
between kernels. With `--engine-process` the engine process inherits the variables.

Reference: PyTorch profiler (torch.profiler.profile, key_averages).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch.profiler import ProfilerActivity, profile

from sits.config import PROFILE_FILE_ENV, PROFILE_STEPS_ENV
from sits.core.errors import InvalidParameterError

_ROW_LIMIT = 40


class StepProfiler:
    """Profiles steps `start` .. `start + count - 1` and writes the table to `path` once.

    Args:
        start: first profiled step (1-based, >= 1).
        count: steps profiled (>= 1).
        path: where the table goes.

    Raises:
        InvalidParameterError: start or count < 1.
    """

    def __init__(self, start: int, count: int, path: str) -> None:
        if start < 1 or count < 1:
            raise InvalidParameterError(
                PROFILE_STEPS_ENV, f"START:COUNT must both be >= 1, got {start}:{count}"
            )
        self.start = start
        self.count = count
        self.path = path
        self.done = False
        self._profile: profile | None = None

    def before_step(self, step: int) -> None:
        """Call before step number `step` (1-based) runs: starts the window at `start`."""
        if step == self.start and self._profile is None and not self.done:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(activities=activities)
            self._profile.start()

    def after_step(self, step: int) -> None:
        """Call after step number `step` ran: ends the window and writes the table."""
        if self._profile is None or step < self.start + self.count - 1:
            return
        prof, self._profile = self._profile, None
        prof.stop()
        self.done = True
        on_gpu = torch.cuda.is_available()
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total",
            row_limit=_ROW_LIMIT,
        )
        with open(self.path, "w") as f:
            f.write(f"# steps {self.start}-{step} ({self.count} steps), torch.profiler\n")
            f.write(table + "\n")


def profiler_from_env(environ: Mapping[str, str]) -> StepProfiler | None:
    """The profiler `SITS_PROFILE_STEPS` asks for, or None when it is unset or empty.

    Raises:
        InvalidParameterError: the value is not START:COUNT with integers >= 1.
    """
    value = environ.get(PROFILE_STEPS_ENV)
    if not value:
        return None
    try:
        start, count = (int(part) for part in value.split(":"))
    except ValueError:
        raise InvalidParameterError(
            PROFILE_STEPS_ENV, f"must be START:COUNT (e.g. 2000:20), got {value!r}"
        ) from None
    path = environ.get(PROFILE_FILE_ENV) or f"sits-profile-{os.getpid()}.txt"
    return StepProfiler(start, count, path)
