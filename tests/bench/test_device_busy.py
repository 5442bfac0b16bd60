"""bench/device_busy.py on the CPU: the offline workload runs to the end on a tiny shape and
the script says that it has no device timing there (the CUDA-event path runs on the GPU
machine, `bash bench/gpu_check.sh device_busy`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_busy.py"


def test_device_busy_runs_the_workload_on_the_cpu(capsys) -> None:
    spec = importlib.util.spec_from_file_location("device_busy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--random-weights", "tiny-llama", "--num-prompts", "3", "--input-len", "12",
            "--output-len", "4", "--async-scheduling", "--sync-debug"]  # fmt: skip
    assert module.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Command: ")
    assert lines[-1].startswith("wall ") and lines[-1].endswith(
        "no device timing on the CPU (the steps run on the host)"
    )
