"""Logit penalties and masks applied before temperature: repetition, frequency/presence, min_tokens.

All functions change `logits` in place, row by row independently (a row's result never depends
on the other rows of the batch). Rows whose parameters disable a penalty are not touched.
Definitions:
- repetition penalty (CTRL, Keskar et al. 2019, as in Hugging Face and vLLM): for each token in
  the prompt or the output, a positive logit is divided by the penalty, a negative one
  multiplied by it.
- frequency and presence penalties (OpenAI API reference, "Parameter details"): over output
  tokens only, logit -= count * frequency_penalty + (count > 0) * presence_penalty.
- min_tokens (vLLM): while fewer than min_tokens tokens were generated, the stop token ids and
  (unless ignore_eos) the EOS ids get logit -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor

from sits.sampling.batch import SamplingState, to_device


def token_counts(
    token_ids_per_row: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> Tensor:
    """How often each token id occurs in each row's list.

    Args:
        token_ids_per_row: one list of token ids per row; ids >= vocab_size are ignored.
        vocab_size: V.
        device: device of the result.

    Returns:
        [num_rows, V] float32 counts.
    """
    num_rows = len(token_ids_per_row)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)  # [R, V]
    lengths = [len(ids) for ids in token_ids_per_row]
    num_ids = sum(lengths)
    if num_ids == 0:
        return counts
    # Row of each id by repeat_interleave, not a Python list per id (every step, every row
    # with a penalty: 256 rows of ~100 tokens took 1.3 ms more on our CPU).
    cols = torch.tensor(
        list(chain.from_iterable(token_ids_per_row)), dtype=torch.long, device=device
    )  # [num_ids]
    rows = torch.repeat_interleave(
        torch.arange(num_rows, device=device),
        torch.tensor(lengths, device=device),
        output_size=num_ids,
    )  # [num_ids]
    keep = cols < vocab_size
    ones = torch.ones(rows.shape[0], dtype=torch.float32, device=device)
    counts.index_put_((rows[keep], cols[keep]), ones[keep], accumulate=True)
    return counts


def apply_repetition_penalty(logits: Tensor, seen_mask: Tensor, penalties: Tensor) -> None:
    """CTRL repetition penalty, in place.

    Args:
        logits: [R, V] float32.
        seen_mask: [R, V] bool, True where the token occurs in the prompt or the output.
        penalties: [R] float32, > 0 (1 = no change).
    """
    penalty = penalties.unsqueeze(1)  # [R, 1]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)  # [R, V]
    logits.copy_(torch.where(seen_mask, penalized, logits))


def apply_frequency_presence_penalties(
    logits: Tensor, output_counts: Tensor, frequency: Tensor, presence: Tensor
) -> None:
    """OpenAI frequency and presence penalties, in place.

    Args:
        logits: [R, V] float32.
        output_counts: [R, V] float32, occurrences of each token among generated tokens.
        frequency: [R] float32 frequency penalties.
        presence: [R] float32 presence penalties.
    """
    logits -= frequency.unsqueeze(1) * output_counts  # [R, V]
    logits -= presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)  # [R, V]


def apply_penalties(logits: Tensor, states: Sequence[SamplingState]) -> None:
    """Apply each row's repetition, frequency and presence penalties, in place.

    Args:
        logits: [B, V] float32, one row per state.
        states: the rows' sampling states.
    """
    num_vocab = logits.shape[1]
    device = logits.device
    rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rep_rows:
        ids = [states[i].prompt_token_ids + list(states[i].output_token_ids) for i in rep_rows]
        seen = token_counts(ids, num_vocab, device) > 0  # [R, V]
        penalties = [states[i].params.repetition_penalty for i in rep_rows]
        index = torch.tensor(rep_rows, dtype=torch.long, device=device)  # [R]
        sub = logits.index_select(0, index)  # [R, V]
        apply_repetition_penalty(sub, seen, torch.tensor(penalties, device=device))
        logits.index_copy_(0, index, sub)
    freq_rows = [
        i
        for i, s in enumerate(states)
        if s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0
    ]
    if freq_rows:
        counts = token_counts([states[i].output_token_ids for i in freq_rows], num_vocab, device)
        frequency = [states[i].params.frequency_penalty for i in freq_rows]
        presence = [states[i].params.presence_penalty for i in freq_rows]
        index = torch.tensor(freq_rows, dtype=torch.long, device=device)  # [R]
        sub = logits.index_select(0, index)  # [R, V]
        apply_frequency_presence_penalties(
            sub,
            counts,
            torch.tensor(frequency, dtype=torch.float32, device=device),
            torch.tensor(presence, dtype=torch.float32, device=device),
        )
        logits.index_copy_(0, index, sub)


def apply_min_tokens(logits: Tensor, states: Sequence[SamplingState]) -> None:
    """Mask stop token ids and EOS (unless ignore_eos) while a row has < min_tokens outputs.

    Args:
        logits: [B, V] float32, changed in place (masked entries become -inf).
        states: the rows' sampling states.
    """
    num_vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, state in enumerate(states):
        for token_id in state.min_tokens_stop_ids():
            if token_id < num_vocab:
                rows.append(i)
                cols.append(token_id)
    if rows:
        device = logits.device
        index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
        logits[index] = -torch.inf
