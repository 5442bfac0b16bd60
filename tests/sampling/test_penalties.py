"""Penalties and min_tokens against hand-computed values."""

from __future__ import annotations

import random

import torch

from sits.core.sampling_params import SamplingParams
from sits.sampling.batch import SamplingState
from sits.sampling.penalties import (
    apply_frequency_presence_penalties,
    apply_min_tokens,
    apply_penalties,
    apply_repetition_penalty,
    token_counts,
)

INF = float("inf")


def state(prompt: list[int], output: list[int], eos=(0,), **kwargs) -> SamplingState:
    return SamplingState.create(
        SamplingParams(**kwargs), prompt, eos, random.Random(0), "cpu", output
    )


def test_token_counts() -> None:
    counts = token_counts([[1, 1, 3], [], [0, 9]], 4, "cpu")  # id 9 >= V is ignored
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -1.0, 3.0, -4.0, 5.0]])
    seen = torch.tensor([[True, True, False, True, False]])
    apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert logits.tolist() == [[1.0, -2.0, 3.0, -8.0, 5.0]]


def test_frequency_and_presence_penalties() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    apply_frequency_presence_penalties(logits, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    # token 1: 1 - 1*0.5 - 0.25; token 2: 1 - 3*0.5 - 0.25
    assert logits.tolist() == [[1.0, 0.25, -0.75, 1.0]]


def test_apply_penalties_per_row() -> None:
    logits = torch.tensor(
        [
            [2.0, -2.0, 4.0, 1.0, 0.0],
            [2.0, -2.0, 4.0, 1.0, 0.0],
            [2.0, -2.0, 4.0, 1.0, 0.0],
        ]
    )
    states = [
        # repetition over prompt (0, 1) and output (2): 2/2, -2*2, 4/2
        state([0, 1], [2], repetition_penalty=2.0),
        # frequency/presence over the output only (the prompt's token 0 is not penalised)
        state([0], [2, 2, 3], frequency_penalty=1.0, presence_penalty=0.5),
        state([0, 1, 2], [3]),  # no penalty
    ]
    apply_penalties(logits, states)
    assert logits.tolist() == [
        [1.0, -4.0, 2.0, 1.0, 0.0],
        [2.0, -2.0, 4.0 - 2.0 - 0.5, 1.0 - 1.0 - 0.5, 0.0],
        [2.0, -2.0, 4.0, 1.0, 0.0],
    ]


def test_repetition_then_frequency_order() -> None:
    logits = torch.tensor([[3.0, -1.0]])
    s = state([], [0, 1], repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.0)
    apply_penalties(logits, [s])
    assert logits.tolist() == [[3.0 / 1.5 - 0.5, -1.0 * 1.5 - 0.5]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    base = [0.5, 1.0, 2.0, 3.0, 4.0]
    logits = torch.tensor([base] * 4)
    states = [
        state([7], [5], eos=(0, 4), min_tokens=2, stop_token_ids=[2]),  # 1 < 2: masked
        state([7], [5, 6], eos=(0, 4), min_tokens=2, stop_token_ids=[2]),  # reached
        state([7], [], eos=(0, 4), min_tokens=1, stop_token_ids=[3], ignore_eos=True),
        state([7], [], eos=(0, 4)),  # no min_tokens
    ]
    apply_min_tokens(logits, states)
    assert logits.tolist() == [
        [-INF, 1.0, -INF, 3.0, -INF],
        base,
        [0.5, 1.0, 2.0, -INF, 4.0],  # ignore_eos: EOS stays possible, stop ids are masked
        base,
    ]
