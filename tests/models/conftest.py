"""Fixtures of the model tests: tiny checkpoints (no tokenizer) and their HF references."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`make(arch, seed=0, **config_overrides) -> checkpoint dir`, cached for the session."""
    from sits.testing.tiny import cached_tiny_checkpoint

    base = tmp_path_factory.mktemp("tiny_models_no_tokenizer")

    def make(arch: str, seed: int = 0, **overrides: object) -> Path:
        return cached_tiny_checkpoint(arch, base, seed=seed, with_tokenizer=False, **overrides)

    return make
