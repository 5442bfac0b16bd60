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
Invariants: each row's token depends only on its own logits, state and generator, never on the
batch; a row's generator advances by exactly one draw of V exponentials per sampled token, and
not at all for greedy rows. The caller's logits tensor is not modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sits.core.outputs import TokenLogprobs
from sits.sampling.logprobs import compute_prompt_logprobs, gather_logprobs, log_softmax_f32
from sits.sampling.penalties import apply_min_tokens, apply_penalties
from sits.sampling.state import SamplingState

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
    """Samples one token per row of a logits batch (see the module docstring for the order)."""

    def __call__(self, logits: Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Sample the next token of each request.

        Args:
            logits: [B, V] float32 logits of each request's last position (not modified).
            states: B sampling states, in the same order; their generators live on the
                logits' device (or are copied there draw by draw).

        Returns:
            SamplerOutput with B token ids and B logprob entries (None where not asked).
        """
        num_rows, _ = logits.shape
        assert num_rows == len(states), "one sampling state per logits row"
        device = logits.device
        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        raw_logprobs = logprob_index = None
        if logprob_rows:
            logprob_index = torch.tensor(logprob_rows, dtype=torch.long, device=device)  # [L]
            raw_logprobs = log_softmax_f32(logits.index_select(0, logprob_index))  # [L, V]

        logits = logits.to(torch.float32, copy=True)  # [B, V]
        apply_penalties(logits, states)
        apply_min_tokens(logits, states)
        token_ids = logits.argmax(dim=-1)  # [B] greedy choice, replaced for random rows
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            index = torch.tensor(random_rows, dtype=torch.long, device=device)  # [R]
            sampled = _sample_random(
                logits.index_select(0, index), [states[i] for i in random_rows]
            )  # [R]
            token_ids.index_copy_(0, index, sampled)

        entries: list[TokenLogprobs | None] = [None] * num_rows
        if raw_logprobs is not None:
            num_top = [states[i].params.logprobs or 0 for i in logprob_rows]
            chosen = token_ids.index_select(0, logprob_index)  # [L]
            rows = gather_logprobs(raw_logprobs, chosen, num_top)
            for i, entry in zip(logprob_rows, rows):
                entries[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=entries)


def _sample_random(logits: Tensor, states: Sequence[SamplingState]) -> Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race with each row's generator.

    Args:
        logits: [R, V] float32 penalized logits of the rows sampled at temperature > 0
            (changed in place).
        states: the R rows' states.

    Returns:
        [R] int64 sampled token ids.
    """
    device = logits.device
    temperatures = torch.tensor(
        [s.params.temperature for s in states], dtype=torch.float32, device=device
    )  # [R]
    logits /= temperatures.unsqueeze(1)
    apply_top_k_top_p(
        logits,
        top_k=[s.params.top_k for s in states],
        top_p=[s.params.top_p for s in states],
    )
    probs = torch.softmax(logits, dim=-1)  # [R, V]
    min_p = [s.params.min_p for s in states]
    if any(p > 0 for p in min_p):
        probs = apply_min_p(probs, torch.tensor(min_p, dtype=torch.float32, device=device))
    noise = torch.stack([exponential_noise(s.generator, probs.shape[1], device) for s in states])
    return (probs / noise).argmax(dim=-1)  # [R]


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
    num_rows, num_vocab = logits.shape
    use_k = [0 < k < num_vocab for k in top_k]
    use_p = [p < 1.0 for p in top_p]
    if not any(use_k) and not any(use_p):
        return
    device = logits.device
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    if any(use_k):
        k = torch.tensor(
            [k if use else num_vocab for k, use in zip(top_k, use_k)], device=device
        )  # [R]
        positions = torch.arange(num_vocab, device=device)  # [V]
        sorted_logits.masked_fill_(positions.unsqueeze(0) >= k.unsqueeze(1), -torch.inf)
    if any(use_p):
        p = torch.tensor(top_p, dtype=torch.float32, device=device)  # [R]
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [R, V]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [R, V]
        drop = mass_before >= p.unsqueeze(1)  # [R, V]
        drop &= torch.tensor(use_p, device=device).unsqueeze(1)  # mass before token 0 is 0
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
