"""Shared fixtures: tiny random checkpoints made once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make(arch, seed=0, **overrides) -> checkpoint dir`, cached for the session."""
    from sits.testing.tiny import make_tiny_checkpoint

    base = tmp_path_factory.mktemp("tiny_models")
    made: dict[tuple, Path] = {}

    def make(arch: str, seed: int = 0, **overrides: object) -> Path:
        key = (arch, seed, tuple(sorted(overrides.items())))
        if key not in made:
            name = f"{arch}-{seed}-{abs(hash(key[2])) % 10**8}"
            made[key] = make_tiny_checkpoint(arch, base / name, seed=seed, **overrides)
        return made[key]

    return make


@pytest.fixture(autouse=True)
def _deterministic_torch() -> None:
    torch.manual_seed(0)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
