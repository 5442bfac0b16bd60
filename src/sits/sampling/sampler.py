"""`Sampler`: turns one step's last-position logits into one token per request, plus logprobs.

Order of operations (as vLLM):
1. logprobs from the RAW logits (float32 log-softmax) for rows that asked for them;
2. penalties: repetition (prompt + output), then frequency and presence (output);
3. min_tokens: EOS and stop token ids masked until enough tokens were generated;
4. greedy rows (temperature 0): argmax of the penalized logits;
5. other rows: divide by temperature, keep the top-k, then the top-p nucleus (Holtzman et al.
   2020, "The Curious Case of Neural Text Degeneration"), softmax, drop tokens below
   min_p * max probability (Nguyen et al. 2024, "Min P Sampling"), then sample with the
   exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) i.i.d. picks i with probability
   p_i / sum(p) (the Gumbel-max trick in another form).
A batch whose rows are all greedy without penalties, min_tokens or logprobs is answered by one
argmax of the raw logits (the same tokens, fewer operations). The rows' parameter tensors are
built once per batch composition (`SamplingBatch`) and reused while the rows stay the same.

Noise: a seeded row (and every row of a sampler without a shared generator) draws from its own
generator, which advances by exactly one draw of V exponentials per sampled token and not at
all for greedy rows, so its token depends only on its own logits, state and generator, never
on the batch. Unseeded rows of a sampler with a shared generator (the runner's, seeded from the
engine seed) draw their noise together in one [U, V] draw per step, in batch order: one call
instead of one per row, reproducible given the same engine seed and the same batches.
The caller's logits tensor is not modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sits.core.outputs import TokenLogprobs
from sits.sampling.batch import SamplingBatch, SamplingState, TopKTopP, top_k_top_p_of
from sits.sampling.logprobs import compute_prompt_logprobs, gather_logprobs, log_softmax_f32
from sits.sampling.penalties import apply_min_tokens, apply_penalties

__all__ = ["Sampler", "SamplerOutput", "compute_prompt_logprobs"]

# Smallest noise value: torch's exponential_ may return exactly 0 (then p / 0 would be inf or
# nan and could pick a masked token).
_MIN_NOISE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """What the sampler chose for each row.

    Attributes:
        token_ids: one sampled token id per row, in batch order.
        logprobs: per row, the chosen token's logprob and its top-N alternatives, or None when
            the request did not ask for logprobs.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples one token per row of a logits batch (see the module docstring for the order).

    Args:
        generator: shared generator of the unseeded rows, on the logits' device; None (the
            default): every row draws from its own state's generator.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator
        self._batch: SamplingBatch | None = None

    def __call__(self, logits: Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample the next token of each request.

        Args:
            logits: [B, V] float32 logits of each request's last position (not modified).
            states: B sampling states, in the same order; their generators live on the
                logits' device (or are copied there draw by draw).

        Returns:
            SamplerOutput with B token ids and B logprob entries (None where not asked).
        """
        num_rows, num_vocab = logits.shape
        assert num_rows == len(states), "one sampling state per logits row"
        batch = self._batch_of(states, num_vocab, logits.device)
        if batch.plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * num_rows)
        raw_logprobs = None
        if batch.logprob_index is not None:
            raw_logprobs = log_softmax_f32(logits.index_select(0, batch.logprob_index))  # [L, V]

        token_ids = self._penalized_choice(logits, states, batch)  # [B]

        entries: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            chosen = token_ids.index_select(0, batch.logprob_index)  # [L]
            rows = gather_logprobs(raw_logprobs, chosen, batch.num_top)
            for i, entry in zip(batch.logprob_rows, rows):
                entries[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=entries)

    def sample_tokens(self, logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
        """`__call__` for rows without logprobs, leaving the tokens on the device (no wait for
        them: async scheduling reads them back after the next step is launched).

        Args:
            logits: [B, V] float32 logits (not modified).
            states: B sampling states; none asks for logprobs.

        Returns:
            [B] int64 token ids on the logits' device.
        """
        batch = self._batch_of(states, logits.shape[1], logits.device)
        assert batch.logprob_index is None, "rows with logprobs go through __call__"
        if batch.plain_greedy:
            return logits.argmax(dim=-1)  # [B]
        return self._penalized_choice(logits, states, batch)

    def _penalized_choice(
        self, logits: Tensor, states: Sequence[SamplingState], batch: SamplingBatch
    ) -> Tensor:
        """[B] int64 tokens from a float32 copy of the [B, V] logits: penalties, min_tokens,
        then `_choose` (steps 2-5 of the module docstring)."""
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        if batch.any_penalties:
            apply_penalties(logits, states)
        if batch.any_min_tokens:
            apply_min_tokens(logits, states)
        return self._choose(logits, states, batch)

    def _batch_of(
        self, states: Sequence[SamplingState], num_vocab: int, device: torch.device
    ) -> SamplingBatch:
        """The cached `SamplingBatch` of these rows, rebuilt when their parameters changed."""
        params = [s.params for s in states]
        shared = self.generator is not None
        batch = self._batch
        if batch is None or not batch.matches(params, num_vocab, device, shared):
            batch = self._batch = SamplingBatch.build(tuple(params), num_vocab, device, shared)
        return batch

    def _choose(
        self, logits: Tensor, states: Sequence[SamplingState], batch: SamplingBatch
    ) -> Tensor:
        """[B] int64 tokens: argmax for greedy rows, the exponential race for the others
        (`logits` [B, V] float32, penalized; changed in place)."""
        if not batch.random_rows:
            return logits.argmax(dim=-1)  # [B]
        index = batch.random_index
        if index is None:  # every row is random
            return self._sample_random(logits, states, batch)
        token_ids = logits.argmax(dim=-1)  # [B] greedy choice, replaced for random rows
        random_states = [states[i] for i in batch.random_rows]
        sampled = self._sample_random(logits.index_select(0, index), random_states, batch)
        return token_ids.index_copy_(0, index, sampled)

    def _sample_random(
        self, logits: Tensor, states: Sequence[SamplingState], batch: SamplingBatch
    ) -> Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race.

        Args:
            logits: [R, V] float32 penalized logits of the random rows (changed in place).
            states: the R rows' states.
            batch: the batch's parameter tensors.

        Returns:
            [R] int64 sampled token ids.
        """
        assert batch.temperatures is not None
        logits /= batch.temperatures
        if batch.filters is not None:
            _apply_top_k_top_p(logits, batch.filters)
        probs = torch.softmax(logits, dim=-1)  # [R, V]
        if batch.min_p is not None:
            probs = apply_min_p(probs, batch.min_p)
        noise = self._noise(probs, states, batch)  # [R, V]
        return (probs / noise).argmax(dim=-1)  # [R]

    def _noise(
        self, probs: Tensor, states: Sequence[SamplingState], batch: SamplingBatch
    ) -> Tensor:
        """[R, V] float32 Exp(1) noise, >= the smallest normal float32: one draw of V values per
        own-generator row from its generator, one [U, V] draw from the shared generator."""
        noise = torch.empty_like(probs)  # [R, V]
        if batch.shared_rows:
            if batch.shared_index is None:  # every random row draws from the shared generator
                noise.exponential_(generator=self.generator)
            else:
                shared = torch.empty(
                    (len(batch.shared_rows), probs.shape[1]), dtype=probs.dtype, device=probs.device
                )  # [U, V]
                shared.exponential_(generator=self.generator)
                noise.index_copy_(0, batch.shared_index, shared)
        for pos in batch.own_rows:
            generator = states[pos].generator
            if generator.device == noise.device:
                noise[pos].exponential_(generator=generator)
            else:
                noise[pos].copy_(exponential_noise(generator, probs.shape[1], noise.device))
        return noise.clamp_min_(_MIN_NOISE)


def exponential_noise(generator: torch.Generator, num_vocab: int, device: torch.device) -> Tensor:
    """Draw V i.i.d. Exp(1) values from `generator` (advances it by one draw of V values).

    Args:
        generator: the request's generator (the draw happens on its device).
        num_vocab: V.
        device: where the result is returned.

    Returns:
        [V] float32 noise, clamped to >= the smallest normal float32.
    """
    noise = torch.empty(num_vocab, dtype=torch.float32, device=generator.device)  # [V]
    noise.exponential_(generator=generator)
    return noise.clamp_min_(_MIN_NOISE).to(device)


def apply_top_k_top_p(logits: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> None:
    """Keep each row's k largest logits, then its top-p nucleus; others become -inf (in place).

    top-k keeps exactly k tokens (ties broken by lower token id, through a stable sort); k <= 0
    disables it. top-p keeps the smallest prefix of the tokens sorted by descending probability
    (renormalised after top-k) whose mass reaches p: a token is kept iff the mass of the tokens
    before it is < p; p = 1 disables it. The most likely token is always kept.

    Args:
        logits: [R, V] float32 (temperature already applied).
        top_k: R values of k.
        top_p: R values of p in (0, 1].
    """
    filters = top_k_top_p_of(top_k, top_p, logits.shape[1], logits.device)
    if filters is not None:
        _apply_top_k_top_p(logits, filters)


def _apply_top_k_top_p(logits: Tensor, filters: TopKTopP) -> None:
    """`apply_top_k_top_p` with the parameters already as tensors (logits [R, V], in place)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    if filters.k is not None:
        sorted_logits.masked_fill_(filters.positions >= filters.k, -torch.inf)
    if filters.p is not None:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [R, V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [R, V]
        drop = mass_before >= filters.p  # [R, V]
        if filters.p_rows is not None:
            drop &= filters.p_rows  # mass before token 0 is 0: rows without top-p keep all
        sorted_logits.masked_fill_(drop, -torch.inf)
    logits.scatter_(1, sorted_ids, sorted_logits)


def apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Zero the probabilities below min_p times each row's largest probability.

    Args:
        probs: [R, V] float32 probabilities.
        min_p: [R] float32 in [0, 1]; 0 disables.

    Returns:
        [R, V] float32, not renormalised (the exponential race does not need it).
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [R, 1]
    return probs.masked_fill(probs < threshold, 0.0)  # [R, V]
