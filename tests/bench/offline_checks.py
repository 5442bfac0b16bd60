"""Assertions shared by the offline benchmark tests."""

from __future__ import annotations

from typing import Any


def check_gpu_only_roofline(device: str, roofline: dict[str, Any], printed: str) -> None:
    """On a GPU the roofline has its fraction; elsewhere none, and the report says why."""
    if device.startswith("cuda"):
        assert roofline["on_gpu"] and roofline["fraction"] is not None
        assert "% of the roofline" in printed
        return
    assert roofline["on_gpu"] is False and roofline["fraction"] is None
    assert "not computed on a CPU" in printed
    assert "% of the roofline" not in printed and "n/a (no GPU)" in printed
