"""What every kernel micro-benchmark here shares: the machine line, how many copies of a
problem keep its data out of L2, and CUDA-graph timing with an eager fallback.

The scripts of this folder run as `python3 bench/kernels/NAME.py`, so they import this module
as `timing` (their folder is on sys.path).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch


def machine_line(device: str) -> str:
    """GPU name, SMs, L2, memory and versions; on the CPU, the processor and Triton's mode."""
    import triton

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if device == "cpu":
        mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "offline compile"
        return f"CPU ({platform.processor() or platform.machine()}), Triton {mode}, {versions}"
    props = torch.cuda.get_device_properties(0)
    l2_mib = getattr(props, "L2_cache_size", 0) / 2**20
    return (
        f"{props.name}, {props.multi_processor_count} SMs, {l2_mib:.0f} MiB L2, "
        f"{props.total_memory / 2**30:.0f} GiB, {versions}"
    )


def num_copies(nbytes: int, device: str, max_copies: int = 32) -> int:
    """Copies of a problem of `nbytes` to cycle through so that one call's data has left L2
    (4x the L2 size) before it is read again; at most `max_copies`, 1 on the CPU."""
    if device == "cpu":
        return 1
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, min(max_copies, -(-4 * l2_bytes // max(1, nbytes))))


def graph_or_eager(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` captured in a CUDA graph (warmed up on a side stream first) and returned as its
    replay; `fn` itself when capture fails (the reason is printed)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as error:  # noqa: BLE001 - a benchmark falls back to eager timing
        print(f"  (graph capture failed, timing eagerly: {error!r})")
        return fn


def elapsed_us(run: Callable[[], object], reps: int) -> float:
    """Mean microseconds of `reps` back-to-back calls of `run`, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def time_us(fn: Callable[[], object], device: str, reps: int) -> float:
    """Mean time of fn in microseconds (CUDA graph replay between events, after 3 warm-up
    replays; wall clock on the CPU)."""
    if device == "cpu":
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6
    run = graph_or_eager(fn)
    for _ in range(3):
        run()
    return elapsed_us(run, reps)
