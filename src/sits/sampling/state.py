"""`SamplingState`: what the sampler keeps for one request between steps.

Invariants: the generator belongs to this request alone and advances only when the request
samples a token at temperature > 0 (one draw of `vocab_size` exponentials per token), so a
seeded request gives the same tokens alone, in any batch, and after preemption as long as the
state (or a copy of its generator state) is kept. An unseeded request served by a sampler with
a shared generator (the engine's) draws from that one instead and leaves its own untouched.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sits.core.sampling_params import SamplingParams

_SEED_MASK = (1 << 64) - 1  # torch generators take seeds in [0, 2**64)


@dataclass(slots=True)
class SamplingState:
    """Per-request sampling state.

    Attributes:
        params: the request's sampling parameters.
        prompt_token_ids: the prompt (repetition penalty).
        output_token_ids: generated tokens; the engine appends to this list (penalties,
            min_tokens). It may be the same list object as the request's.
        generator: the request's own random generator, on the device the sampler runs on.
        eos_token_ids: the model's EOS ids (masked while fewer than min_tokens exist, unless
            ignore_eos).
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator
    eos_token_ids: Sequence[int] = field(default_factory=tuple)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: Sequence[int],
        seed_source: random.Random,
        device: torch.device | str = "cpu",
        output_token_ids: list[int] | None = None,
    ) -> SamplingState:
        """A new state whose generator is seeded with `params.seed`, else from `seed_source`.

        Args:
            params: sampling parameters.
            prompt_token_ids: the prompt.
            eos_token_ids: the model's EOS ids.
            seed_source: the engine's random source (seeded from the engine seed, so runs
                are reproducible); drawn from only when `params.seed` is None.
            device: device of the generator (the logits' device).
            output_token_ids: the list the engine appends generated tokens to.
        """
        seed = params.seed if params.seed is not None else seed_source.getrandbits(63)
        return cls(
            params=params,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids if output_token_ids is not None else [],
            generator=make_generator(seed, device),
            eos_token_ids=tuple(eos_token_ids),
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def min_tokens_stop_ids(self) -> list[int]:
        """Ids masked while fewer than `params.min_tokens` tokens were generated."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        ids = list(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on `device` seeded with `seed` (any Python int, taken mod 2**64)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator
