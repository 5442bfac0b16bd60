"""Small helpers shared by the Triton kernels: availability checks and launch arithmetic.

Importing this module never imports triton, so callers can ask whether the Triton kernels can
run before importing any `*_triton` module (those import triton at the top).

Invariants:
- Triton decides at decoration time (`@triton.jit`, when a kernel module is first imported)
  whether kernels are compiled for the GPU or run by its CPU interpreter
  (`TRITON_INTERPRET=1`); `kernels_interpreted` reports what was decided, it reads no
  environment variable itself.
"""

from __future__ import annotations

import importlib.util

import torch


def has_triton() -> bool:
    """True when the `triton` package is installed (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def kernels_interpreted() -> bool:
    """True when sits' Triton kernels run in Triton's CPU interpreter.

    Imports the KV-write kernel module (and so triton); call only when `has_triton()`.
    """
    from triton.runtime.interpreter import InterpretedFunction

    from sits.kernels.kv_write_triton import write_kv_kernel

    return isinstance(write_kv_kernel, InterpretedFunction)


def triton_runs_on(device: torch.device) -> bool:
    """True when the Triton kernels can run on tensors of `device`.

    Compiled kernels need a CUDA device; the interpreter (tests on the CPU) takes CPU tensors.
    """
    if not has_triton():
        return False
    if kernels_interpreted():
        return device.type == "cpu"
    return device.type == "cuda"


def next_power_of_2(value: int) -> int:
    """Smallest power of two >= value (>= 1); `tl.arange` extents must be powers of two."""
    return 1 << max(0, int(value) - 1).bit_length()


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division of positive integers."""
    return -(-numerator // denominator)


def as_bytes(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor viewed as uint8 (kernels read and write flags as bytes); other dtypes are
    returned unchanged."""
    return flags.view(torch.uint8) if flags.dtype == torch.bool else flags


def check_launch_fields(
    config: object, powers_of_two: tuple[str, ...], at_least_one: tuple[str, ...]
) -> None:
    """Validate a launch-config dataclass's integer fields by name.

    Raises:
        ValueError: a field of `powers_of_two` that is not a power of two, or one of
            `at_least_one` below 1 (the message names the field and its value).
    """
    for name in powers_of_two:
        value = getattr(config, name)
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    for name in at_least_one:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
