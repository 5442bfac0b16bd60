"""`SamplingState`, what the sampler keeps for one request between steps, and `SamplingBatch`,
what one batch's sampling parameters ask of the sampler, as row lists and device tensors built
once per batch composition.

A decode batch usually keeps the same requests for many steps, so the per-row parameter
tensors (temperatures, top-k, top-p, min-p), the row index tensors and the flags that pick the
sampler's fast paths are built when the rows' parameters change and reused otherwise (the
sampler keeps the last batch and compares the rows' `SamplingParams` objects by identity).

Invariants: a `SamplingBatch` depends only on its rows' `SamplingParams` (never changed once a
request is added), the vocabulary size, the device and whether the sampler has a shared
generator; per-step state (outputs for penalties and min_tokens, generators) is read by the
sampler each step.

A `SamplingState`'s generator belongs to its request alone and advances only when the request
samples a token at temperature > 0 (one draw of `vocab_size` exponentials per token), so a
seeded request gives the same tokens alone, in any batch, and after preemption as long as the
state (or a copy of its generator state) is kept. An unseeded request served by a sampler with
a shared generator (the engine's) draws from that one instead and leaves its own untouched.

Host lists become device tensors through `to_device` (the sampler's parameter tensors here,
the runner's step inputs too), without waiting for the device: `torch.tensor(values,
device="cuda")` copies from pageable memory, which CUDA orders after all the work already
queued on the stream, so the host waits for the device. With async scheduling
(`sits.engine.async_step`) the host prepares a step while the step before it runs, so such a
copy would stall it for a whole step. `to_device` stages the values in pinned memory (torch's
caching host allocator, which keeps the block until the copy has run) and copies them with
non_blocking=True, which returns at once.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sits.core.sampling_params import SamplingParams

_SEED_MASK = (1 << 64) - 1  # torch generators take seeds in [0, 2**64)


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype,
              device: torch.device) -> Tensor:  # fmt: skip
    """[len(values)] tensor of `dtype` on `device`; on CUDA the copy is queued, not waited for."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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
        """Ids masked while fewer than `params.min_tokens` tokens were generated (none for a
        constrained request: its grammar decides where the output ends)."""
        params = self.params
        if len(self.output_token_ids) >= params.min_tokens or params.structured_outputs:
            return []
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids.extend(self.eos_token_ids)
        return ids


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on `device` seeded with `seed` (any Python int, taken mod 2**64)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed & _SEED_MASK)
    return generator


@dataclass(frozen=True, slots=True)
class TopKTopP:
    """Per-row top-k and top-p parameters as tensors (see `apply_top_k_top_p`).

    Attributes:
        k: [R, 1] int64 tokens kept per row (V where the row's top-k is off), or None when no
            row uses top-k.
        positions: [1, V] int64 sorted positions 0..V-1 (None with k).
        p: [R, 1] float32 nucleus mass, or None when no row uses top-p.
        p_rows: [R, 1] bool, rows that use top-p, or None when every row does (or none).
    """

    k: Tensor | None
    positions: Tensor | None
    p: Tensor | None
    p_rows: Tensor | None


def has_penalties(params: SamplingParams) -> bool:
    """True when a repetition, frequency or presence penalty is set (they read the request's
    earlier tokens)."""
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


def top_k_top_p_of(
    top_k: Sequence[int], top_p: Sequence[float], num_vocab: int, device: torch.device
) -> TopKTopP | None:
    """The filter tensors of R rows, or None when no row filters (k <= 0 or >= V, p == 1).

    Args:
        top_k: R values of k.
        top_p: R values of p in (0, 1].
        num_vocab: V.
        device: where the tensors live.
    """
    use_k = [0 < k < num_vocab for k in top_k]
    use_p = [p < 1.0 for p in top_p]
    any_k, any_p = any(use_k), any(use_p)
    if not any_k and not any_p:
        return None
    k = positions = p = p_rows = None
    if any_k:
        ks = [k if use else num_vocab for k, use in zip(top_k, use_k)]
        k = to_device(ks, torch.long, device).unsqueeze(1)  # [R, 1]
        positions = torch.arange(num_vocab, device=device).unsqueeze(0)  # [1, V]
    if any_p:
        p = to_device(top_p, torch.float32, device).unsqueeze(1)  # [R, 1]
        if not all(use_p):
            p_rows = to_device(use_p, torch.bool, device).unsqueeze(1)  # [R, 1]
    return TopKTopP(k, positions, p, p_rows)


def _index(rows: list[int], num_rows: int, device: torch.device) -> Tensor | None:
    """[len(rows)] int64 index of `rows`, or None when they are all rows 0..num_rows-1."""
    if len(rows) == num_rows:
        return None
    return to_device(rows, torch.long, device)


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Row lists, flags and parameter tensors of one batch (B rows).

    Attributes:
        params: the rows' parameters (the cache key).
        num_vocab, device, shared: V, the logits' device, whether unseeded rows draw from the
            sampler's shared generator.
        plain_greedy: every row is greedy with no penalty, min_tokens or logprobs: the
            sampler's answer is the argmax of the raw logits.
        any_penalties: some row has a repetition, frequency or presence penalty.
        any_min_tokens: some row has min_tokens > 0.
        logprob_rows: rows that asked for logprobs; logprob_index: [L] int64 of them (None when
            none); num_top: their numbers of top alternatives.
        random_rows: rows sampled at temperature > 0; random_index: [R] int64 of them (None
            when every row is random or none is).
        temperatures: [R, 1] float32 (None without random rows).
        filters: top-k / top-p of the random rows, or None when none filters.
        min_p: [R] float32 (None when no random row uses min-p).
        own_rows: positions among the random rows that draw noise from their own generator
            (seeded rows; every random row without a shared generator).
        shared_rows: the other positions (unseeded rows with a shared generator).
        shared_index: [U] int64 of `shared_rows` (None when they are all random rows or none).
    """

    params: tuple[SamplingParams, ...]
    num_vocab: int
    device: torch.device
    shared: bool
    plain_greedy: bool
    any_penalties: bool
    any_min_tokens: bool
    logprob_rows: list[int]
    logprob_index: Tensor | None
    num_top: list[int]
    random_rows: list[int]
    random_index: Tensor | None
    temperatures: Tensor | None
    filters: TopKTopP | None
    min_p: Tensor | None
    own_rows: list[int]
    shared_rows: list[int]
    shared_index: Tensor | None

    def matches(
        self, params: Sequence[SamplingParams], num_vocab: int, device: torch.device, shared: bool
    ) -> bool:
        """True when this batch was built for these rows: the very same `SamplingParams`
        objects in the same order (identity, not value: a C-level scan, so a steady batch
        costs nothing per step; `params` keeps them alive, so their ids cannot be reused)."""
        return (
            len(params) == len(self.params)
            and num_vocab == self.num_vocab
            and shared == self.shared
            and device == self.device
            and all(map(operator.is_, params, self.params))
        )

    @classmethod
    def build(
        cls, params: tuple[SamplingParams, ...], num_vocab: int, device: torch.device, shared: bool
    ) -> SamplingBatch:
        """Classify the rows and build their tensors.

        Args:
            params: one `SamplingParams` per row, in batch order.
            num_vocab: V.
            device: the logits' device.
            shared: unseeded random rows draw from the sampler's shared generator.
        """
        num_rows = len(params)
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        any_penalties = any(has_penalties(p) for p in params)
        any_min_tokens = any(p.min_tokens > 0 for p in params)
        temperatures = filters = min_p = None
        own_rows: list[int] = []
        shared_rows: list[int] = []
        if random_rows:
            rand = [params[i] for i in random_rows]
            temperatures = to_device(
                [p.temperature for p in rand], torch.float32, device
            ).unsqueeze(1)  # [R, 1]
            filters = top_k_top_p_of(
                [p.top_k for p in rand], [p.top_p for p in rand], num_vocab, device
            )
            if any(p.min_p > 0 for p in rand):
                min_p = to_device([p.min_p for p in rand], torch.float32, device)
            for pos, p in enumerate(rand):
                (shared_rows if shared and p.seed is None else own_rows).append(pos)
        return cls(
            params=params,
            num_vocab=num_vocab,
            device=device,
            shared=shared,
            plain_greedy=not (random_rows or logprob_rows or any_penalties or any_min_tokens),
            any_penalties=any_penalties,
            any_min_tokens=any_min_tokens,
            logprob_rows=logprob_rows,
            logprob_index=None if not logprob_rows else to_device(logprob_rows, torch.long, device),
            num_top=[params[i].logprobs or 0 for i in logprob_rows],
            random_rows=random_rows,
            random_index=_index(random_rows, num_rows, device) if random_rows else None,
            temperatures=temperatures,
            filters=filters,
            min_p=min_p,
            own_rows=own_rows,
            shared_rows=shared_rows,
            shared_index=_index(shared_rows, len(random_rows), device) if shared_rows else None,
        )


def needs_host_tokens(params: SamplingParams) -> bool:
    """True when sampling for these parameters needs every earlier token on the host (or
    returns logprobs, read back with their token): such a request's steps are not launched
    ahead (`ModelRunner.can_launch`). A constrained request is one: its grammar's mask for a
    token depends on the token before it, which the host's matcher must have accepted."""
    return (
        params.logprobs is not None
        or params.prompt_logprobs is not None
        or has_penalties(params)
        or params.structured_outputs is not None
    )
