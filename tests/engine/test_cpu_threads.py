"""torch's threads on the engine's CPU path: 1 by default, never over the user's choice."""

from __future__ import annotations

import pytest
import torch

from sits import LLM
from sits.config import DEFAULT_CPU_THREADS, EngineConfig, cpu_threads_of
from sits.core.errors import InvalidParameterError


@pytest.mark.parametrize(
    ("cpu_threads", "env", "expected"),
    [
        (None, {}, DEFAULT_CPU_THREADS),
        (None, {"OMP_NUM_THREADS": "4"}, None),  # torch follows OMP_NUM_THREADS: keep it
        (None, {"MKL_NUM_THREADS": "4"}, None),
        (None, {"SITS_CPU_THREADS": "3"}, 3),
        (None, {"SITS_CPU_THREADS": "3", "OMP_NUM_THREADS": "4"}, 3),
        (None, {"SITS_CPU_THREADS": "0"}, None),
        (2, {"SITS_CPU_THREADS": "3", "OMP_NUM_THREADS": "4"}, 2),  # the field first
        (0, {}, None),
    ],
)
def test_cpu_threads_of(cpu_threads, env, expected) -> None:
    assert DEFAULT_CPU_THREADS == 1
    assert cpu_threads_of(cpu_threads, env) == expected


def test_bad_values_are_refused() -> None:
    with pytest.raises(InvalidParameterError, match="SITS_CPU_THREADS must be an integer >= 0"):
        cpu_threads_of(None, {"SITS_CPU_THREADS": "many"})
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(model="m", cpu_threads=-1)
    assert info.value.param == "cpu_threads"


@pytest.fixture
def torch_threads():
    """Start each test at 2 torch threads and restore the count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("kwargs", "env", "expected"),
    [
        ({}, {}, 1),
        ({}, {"OMP_NUM_THREADS": "2"}, 2),
        ({"cpu_threads": 0}, {}, 2),  # e.g. the user's own torch.set_num_threads(2)
        ({}, {"SITS_CPU_THREADS": "3"}, 3),
    ],
)
def test_the_engine_sets_torch_threads_on_the_cpu(
    tiny_model_factory, torch_threads, monkeypatch, kwargs, env, expected
) -> None:
    for name in ("SITS_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    LLM(str(tiny_model_factory("llama")), dtype="float32", device="cpu", **kwargs)
    assert torch.get_num_threads() == expected
