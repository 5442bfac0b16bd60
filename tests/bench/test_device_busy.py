"""sits.bench.device_busy on the CPU: the offline workload runs to the end on a tiny shape and
the script says that it has no device timing there (the CUDA-event path runs on the GPU
machine, `bash bench/gpu_check.sh device_busy`)."""

from __future__ import annotations

from sits.bench import device_busy


def test_device_busy_runs_the_workload_on_the_cpu(capsys) -> None:
    argv = ["--random-weights", "tiny-llama", "--num-prompts", "3", "--input-len", "12",
            "--output-len", "4", "--async-scheduling", "--sync-debug"]  # fmt: skip
    assert device_busy.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Command: ")
    assert lines[-1].startswith("wall ") and lines[-1].endswith(
        "no device timing on the CPU (the steps run on the host)"
    )
