"""Logprob values, ranks and top-N order against torch.log_softmax."""

from __future__ import annotations

import random

import torch

from sits.core.sampling_params import SamplingParams
from sits.sampling.batch import SamplingState
from sits.sampling.logprobs import compute_prompt_logprobs, gather_logprobs
from sits.sampling.sampler import Sampler


def test_gather_logprobs_exact() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, -1.0]])
    logprobs = torch.log_softmax(logits, dim=-1)
    entries = gather_logprobs(logprobs, torch.tensor([2, 3]), [2, 0])
    assert entries[0].token_ids == [2, 1, 2]
    assert entries[0].ranks == [2, 1, 2]
    assert entries[0].logprobs == [
        logprobs[0, 2].item(),
        logprobs[0, 1].item(),
        logprobs[0, 2].item(),
    ]
    assert entries[1].token_ids == [3]
    assert entries[1].ranks == [4]
    assert entries[1].logprobs == [logprobs[1, 3].item()]


def test_ranks_count_strictly_larger_logprobs() -> None:
    logits = torch.tensor([[2.0, 2.0, 1.0, 2.0]])
    entry = gather_logprobs(torch.log_softmax(logits, -1), torch.tensor([3]), [1])[0]
    assert entry.ranks == [1, 1]
    entry = gather_logprobs(torch.log_softmax(logits, -1), torch.tensor([2]), [0])[0]
    assert entry.ranks == [4]


def test_prompt_logprobs_match_log_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    targets = [3, 7, 7, 49, 0]
    entries = compute_prompt_logprobs(logits, targets, 4)
    expected = torch.log_softmax(logits, -1)
    for row, (entry, target) in enumerate(zip(entries, targets)):
        top = torch.topk(expected[row], 4)
        assert entry.token_ids == [target] + top.indices.tolist()
        assert entry.logprobs == [expected[row, target].item()] + top.values.tolist()
        rank = int((expected[row] > expected[row, target]).sum()) + 1
        assert entry.ranks == [rank, 1, 2, 3, 4]
        assert entry.logprobs[1:] == sorted(entry.logprobs[1:], reverse=True)


def test_sampler_logprobs_come_from_raw_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 40, generator=gen).clamp(-2.5, 2.5)
    logits[0, 1] = 4.0  # the raw argmax, a prompt token: the penalty makes it 4 / 3
    logits[0, 5] = 3.0
    raw = logits.clone()
    states = [
        SamplingState.create(
            SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=3.0),
            [1, 2, 3],
            (0,),
            random.Random(0),
        ),
        SamplingState.create(SamplingParams(temperature=1.0, seed=5), [1], (0,), random.Random(0)),
        SamplingState.create(
            SamplingParams(temperature=0.5, top_k=3, logprobs=0, seed=9),
            [1],
            (0,),
            random.Random(0),
        ),
    ]
    out = Sampler()(logits, states)
    assert torch.equal(logits, raw)  # the caller's logits are untouched
    expected = torch.log_softmax(raw, -1)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    chosen = out.token_ids[0]
    assert chosen == 5
    top = torch.topk(expected[0], 5)
    assert first.token_ids == [chosen] + top.indices.tolist()
    assert first.logprobs == [expected[0, chosen].item()] + top.values.tolist()
    assert first.ranks[0] == 2  # ranked under the raw distribution, where token 1 leads
    assert first.ranks[1:] == [1, 2, 3, 4, 5]
    third = out.logprobs[2]
    assert third.token_ids == [out.token_ids[2]]
    assert third.logprobs == [expected[2, out.token_ids[2]].item()]
