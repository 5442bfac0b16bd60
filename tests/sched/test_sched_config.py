"""SchedulerConfig: validation and construction from EngineConfig."""

from __future__ import annotations

import dataclasses

import pytest

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from sits.sched import SchedulerConfig


def test_defaults_and_engine_config_mapping() -> None:
    config = SchedulerConfig(max_model_len=4096, num_blocks=100)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.block_size) == (
        2048,
        256,
        16,
    )
    assert config.enable_prefix_caching and config.num_usable_blocks == 99
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8  # type: ignore[misc]
    engine = EngineConfig(
        model="m",
        block_size=8,
        max_num_batched_tokens=512,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    mapped = SchedulerConfig.from_engine_config(engine, num_blocks=10, max_model_len=256)
    assert mapped == SchedulerConfig(
        max_num_batched_tokens=512,
        max_num_seqs=4,
        max_model_len=256,
        block_size=8,
        num_blocks=10,
        enable_prefix_caching=False,
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_num_batched_tokens", 0),
        ("max_num_seqs", 0),
        ("max_model_len", 0),
        ("block_size", 0),
        ("num_blocks", 1),
    ],
)
def test_invalid_limits_raise_naming_the_parameter(field: str, value: int) -> None:
    values = {"max_model_len": 64, "num_blocks": 8, field: value}
    with pytest.raises(InvalidParameterError) as info:
        SchedulerConfig(**values)
    assert info.value.param == field
