"""Sampler: greedy, filters, seeded reproducibility (alone, batched, resumed) and frequencies."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sits.core.sampling_params import SamplingParams
from sits.sampling.batch import SamplingState, make_generator
from sits.sampling.sampler import Sampler, apply_min_p, apply_top_k_top_p, exponential_noise

INF = float("inf")
VOCAB = 64


def new_state(
    seed_source: int = 0, prompt=(1, 2, 3), eos=(0,), device: str = "cpu", **kwargs
) -> SamplingState:
    params = SamplingParams(**kwargs)
    return SamplingState.create(params, list(prompt), eos, random.Random(seed_source), device)


def logits_stream(num_steps: int, num_vocab: int = VOCAB, seed: int = 0) -> list[torch.Tensor]:
    """Fixed per-step logits ([num_vocab] each), flat enough that sampling varies."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_vocab, generator=gen) * 0.5 for _ in range(num_steps)]


def run_batched(
    target: SamplingState,
    others: list[SamplingState],
    position: int,
    steps: list[torch.Tensor],
) -> list[int]:
    """Sample `target` at row `position` among `others`, appending outputs as the engine does."""
    sampler = Sampler()
    tokens: list[int] = []
    gen = torch.Generator().manual_seed(99)
    for step_logits in steps:
        rows = [torch.randn(VOCAB, generator=gen) for _ in others]
        rows.insert(position, step_logits)
        states = list(others)
        states.insert(position, target)
        out = sampler(torch.stack(rows).to(target.generator.device), states)
        for s, t in zip(states, out.token_ids):
            s.output_token_ids.append(t)
        tokens.append(out.token_ids[position])
    return tokens


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 100, generator=gen)
    states = [new_state(temperature=0.0, top_k=5, top_p=0.5, seed=i) for i in range(8)]
    before = [s.generator.get_state() for s in states]
    out = Sampler()(logits, states)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    # Greedy rows never advance their generator.
    assert all(torch.equal(b, s.generator.get_state()) for b, s in zip(before, states))


def test_top_k_keeps_exactly_k_with_stable_ties() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0], [2.0, 2.0, 2.0, 1.0, 2.0]])
    apply_top_k_top_p(logits, top_k=[2, 2], top_p=[1.0, 1.0])
    assert logits.tolist() == [[-INF, 4.0, 3.0, -INF, -INF], [2.0, 2.0, -INF, -INF, -INF]]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = probs.log().repeat(4, 1)  # [4, 4]
    expected_kept = {0.3: [0], 0.7: [0, 1], 0.8: [0, 1, 2], 1.0: [0, 1, 2, 3]}
    apply_top_k_top_p(logits, top_k=[0, -1, 0, 0], top_p=list(expected_kept))
    for row, kept in enumerate(expected_kept.values()):
        assert torch.isfinite(logits[row]).nonzero().flatten().tolist() == kept
        assert logits[row, kept].tolist() == probs[kept].log().tolist()


def test_top_p_applies_after_top_k_renormalisation() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    logits = probs.log()
    apply_top_k_top_p(logits, top_k=[2], top_p=[0.5])
    # After top-k the kept mass is 0.4/0.7 = 0.57 >= 0.5 already: only token 0 remains.
    assert torch.isfinite(logits).nonzero()[:, 1].tolist() == [0]
    logits = probs.log()
    apply_top_k_top_p(logits, top_k=[0], top_p=[0.5])
    assert torch.isfinite(logits).nonzero()[:, 1].tolist() == [0, 1]


def test_min_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs, torch.tensor([0.2, 0.0]))
    assert torch.equal(out, torch.tensor([[0.5, 0.3, 0.15, 0.0], [0.5, 0.3, 0.15, 0.05]]))


def test_filters_restrict_sampled_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.9, -1.0]]).repeat(50, 1)
    sampler = Sampler()
    top1 = [new_state(temperature=1.0, top_k=1, seed=i) for i in range(50)]
    assert sampler(logits, top1).token_ids == [1] * 50
    top2 = [new_state(temperature=2.0, top_k=2, seed=i) for i in range(50)]
    assert set(sampler(logits, top2).token_ids) == {1, 3}
    # min_p 0.9 of p(1) = e^1/Z keeps tokens with logit >= 1 + ln(0.9) = 0.895: ids 1 and 3.
    minp = [new_state(temperature=1.0, min_p=0.9, seed=i) for i in range(50)]
    assert set(sampler(logits, minp).token_ids) == {1, 3}


def test_min_tokens_masks_eos_in_sampler() -> None:
    logits = torch.tensor([[9.0, 1.0, 2.0, 0.0]])
    s = new_state(temperature=0.0, min_tokens=2, eos=(0,))
    sampler = Sampler()
    assert sampler(logits, [s]).token_ids == [2]
    s.output_token_ids.extend([2, 2])
    assert sampler(logits, [s]).token_ids == [0]


def test_seeded_request_same_alone_and_batched() -> None:
    steps = logits_stream(20)
    params = dict(temperature=0.9, top_p=0.95, seed=1234, frequency_penalty=0.3)
    alone = run_batched(new_state(**params), [], 0, steps)
    others = [
        new_state(temperature=0.0),
        new_state(temperature=1.3, top_k=5, seed=7),
        new_state(temperature=0.7, min_p=0.05, repetition_penalty=1.2, seed=8),
    ]
    batched = run_batched(new_state(**params), others, 2, steps)
    assert alone == batched
    others = [new_state(temperature=1.0, seed=3)]
    assert run_batched(new_state(**params), others, 0, steps) == alone
    assert len(set(alone)) > 5  # really sampled, not a constant


def test_seeded_request_same_after_recreating_state() -> None:
    steps = logits_stream(20)
    reference = run_batched(new_state(temperature=1.0, seed=42), [], 0, steps)
    first = new_state(temperature=1.0, seed=42)
    head = run_batched(first, [], 0, steps[:10])
    # Preemption: a new state object at the same generator position and the same outputs.
    generator = torch.Generator()
    generator.set_state(first.generator.get_state())
    resumed = SamplingState(
        first.params, first.prompt_token_ids, list(first.output_token_ids), generator
    )
    assert head + run_batched(resumed, [], 0, steps[10:]) == reference
    # The generator advanced exactly one V-sized draw per sampled token: replaying 10 draws
    # on a fresh generator lands on the same position.
    replayed = make_generator(42)
    for _ in range(10):
        exponential_noise(replayed, VOCAB, torch.device("cpu"))
    again = SamplingState(first.params, first.prompt_token_ids, head[:], replayed)
    assert run_batched(again, [], 0, steps[10:]) == reference[10:]


def test_different_seeds_differ_and_n_style_seeds_differ() -> None:
    steps = logits_stream(20)
    runs = [run_batched(new_state(temperature=1.0, seed=s), [], 0, steps) for s in range(10, 14)]
    assert len({tuple(r) for r in runs}) == 4  # seeds s..s+3 as for n=4: all different
    assert run_batched(new_state(temperature=1.0, seed=10), [], 0, steps) == runs[0]


def test_unseeded_requests_follow_the_engine_seed() -> None:
    steps = logits_stream(15)

    def run(engine_seed: int) -> list[int]:
        source = random.Random(engine_seed)
        params = SamplingParams(temperature=1.0)
        state = SamplingState.create(params, [1], (0,), source)
        return run_batched(state, [], 0, steps)

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_negative_and_huge_seeds_are_accepted() -> None:
    assert make_generator(-1).initial_seed() == (1 << 64) - 1
    assert make_generator(1 << 70).initial_seed() == 0


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_frequencies_match_softmax(temperature: float) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().repeat(100, 1)  # [100, 4]
    states = [new_state(temperature=temperature, seed=1000 + i) for i in range(100)]
    sampler = Sampler()
    counts = torch.zeros(4)
    num_steps = 100
    for _ in range(num_steps):
        counts += torch.bincount(torch.tensor(sampler(logits, states).token_ids), minlength=4)
    num_samples = 100 * num_steps
    expected = torch.softmax(probs.log() / temperature, dim=-1)
    for p, c in zip(expected.tolist(), counts.tolist()):
        # Within 4 standard deviations of a binomial count (fixed seeds: deterministic).
        assert abs(c / num_samples - p) <= 4 * math.sqrt(p * (1 - p) / num_samples)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_sampling_batch_invariant_on_cuda() -> None:
    steps = logits_stream(30)
    params = dict(temperature=0.8, top_k=20, top_p=0.9, seed=77, device="cuda")
    alone = run_batched(new_state(**params), [], 0, steps)
    others = [
        new_state(temperature=0.0, device="cuda"),
        new_state(temperature=1.2, min_p=0.02, seed=5, device="cuda"),
        new_state(temperature=0.6, presence_penalty=0.5, seed=6, device="cuda"),
    ]
    assert run_batched(new_state(**params), others, 1, steps) == alone
    assert len(set(alone)) > 5
    greedy = run_batched(new_state(temperature=0.0, device="cuda"), others[1:], 0, steps)
    assert greedy == [int(x.argmax()) for x in steps]
