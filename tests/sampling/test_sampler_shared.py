"""Sampler with a shared generator for unseeded rows, the all-greedy fast path and the cached
per-batch parameter tensors."""

from __future__ import annotations

import math
import random

import torch

from sits.core.sampling_params import SamplingParams
from sits.sampling.batch import SamplingState, make_generator
from sits.sampling.sampler import Sampler

VOCAB = 64


def new_state(**kwargs) -> SamplingState:
    params = SamplingParams(**kwargs)
    return SamplingState.create(params, [1, 2, 3], (0,), random.Random(0))


def steps_of(num_steps: int, num_rows: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_rows, VOCAB, generator=gen) * 0.5 for _ in range(num_steps)]


def run(sampler: Sampler, states: list[SamplingState], steps: list[torch.Tensor]) -> list[list]:
    """Each row's tokens over the steps, appending outputs as the engine does."""
    tokens: list[list[int]] = [[] for _ in states]
    for logits in steps:
        out = sampler(logits, states)
        for row, (state, token) in enumerate(zip(states, out.token_ids)):
            state.output_token_ids.append(token)
            tokens[row].append(token)
    return tokens


def mixed_batch() -> list[SamplingState]:
    return [
        new_state(temperature=1.0, top_p=0.9),  # unseeded: shared generator
        new_state(temperature=0.0),  # greedy
        new_state(temperature=0.8, seed=11, top_k=8),  # seeded: its own generator
        new_state(temperature=1.2, min_p=0.05),  # unseeded
    ]


def test_unseeded_rows_follow_the_shared_generator_seeded_rows_their_own() -> None:
    steps = steps_of(20, 4)
    shared = run(Sampler(make_generator(5)), mixed_batch(), steps)
    again = run(Sampler(make_generator(5)), mixed_batch(), steps)
    other_seed = run(Sampler(make_generator(6)), mixed_batch(), steps)
    own_generators = run(Sampler(), mixed_batch(), steps)
    assert shared == again
    assert other_seed[0] != shared[0] and other_seed[3] != shared[3]
    # The seeded and greedy rows never touch the shared generator.
    assert shared[1] == other_seed[1] == own_generators[1] == [int(s[1].argmax()) for s in steps]
    assert shared[2] == other_seed[2] == own_generators[2]
    assert len(set(shared[0])) > 5 and len(set(shared[2])) > 3  # really sampled


def test_seeded_row_same_alone_and_among_unseeded_rows() -> None:
    steps = steps_of(20, 3, seed=1)
    row_steps = [s[1:2] for s in steps]  # [1, V] each: the seeded row's logits alone
    alone = run(Sampler(make_generator(0)), [new_state(temperature=0.9, seed=3)], row_steps)[0]
    batch = [new_state(temperature=1.0), new_state(temperature=0.9, seed=3), new_state()]
    assert run(Sampler(make_generator(0)), batch, steps)[1] == alone


def test_shared_generator_frequencies_match_softmax() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().repeat(100, 1)  # [100, 4]
    states = [new_state(temperature=1.0) for _ in range(100)]
    sampler = Sampler(make_generator(123))
    counts = torch.zeros(4)
    num_steps = 100
    for _ in range(num_steps):
        counts += torch.bincount(torch.tensor(sampler(logits, states).token_ids), minlength=4)
    num_samples = 100 * num_steps
    for p, c in zip(probs.tolist(), counts.tolist()):
        # Within 4 standard deviations of a binomial count (fixed seeds: deterministic).
        assert abs(c / num_samples - p) <= 4 * math.sqrt(p * (1 - p) / num_samples)


def test_greedy_fast_path_and_general_path_agree() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=gen)
    before = logits.clone()
    plain = [new_state(temperature=0.0) for _ in range(6)]
    with_logprobs = [new_state(temperature=0.0, logprobs=2) for _ in range(6)]
    sampler = Sampler(make_generator(0))
    fast = sampler(logits, plain)
    general = sampler(logits, with_logprobs)
    assert fast.token_ids == general.token_ids == logits.argmax(dim=-1).tolist()
    assert fast.logprobs == [None] * 6
    assert [e.token_ids[0] for e in general.logprobs] == fast.token_ids
    assert torch.equal(logits, before)  # the caller's logits are never modified


def test_batch_parameters_rebuilt_when_rows_change() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.9, -1.0]]).repeat(3, 1)
    sampler = Sampler(make_generator(0))
    greedy = [new_state(temperature=0.0) for _ in range(3)]
    assert sampler(logits, greedy).token_ids == [1, 1, 1]
    top1 = [new_state(temperature=1.0, top_k=1) for _ in range(3)]
    assert sampler(logits, top1).token_ids == [1, 1, 1]
    # Same number of rows, different parameters: the cached tensors must not be reused.
    penalized = [new_state(temperature=0.0, min_tokens=3, stop_token_ids=[1]) for _ in range(3)]
    assert sampler(logits, penalized).token_ids == [3, 3, 3]
    assert sampler(logits, greedy[:2] + penalized[2:]).token_ids == [1, 1, 3]
