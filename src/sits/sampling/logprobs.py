"""Logprobs of chosen (or prompt) tokens and their top-N alternatives.

Values are the float32 log-softmax of the RAW logits, before penalties, temperature or
truncation (what vLLM and the OpenAI API return). Ranks are 1-based: a token's rank is one plus
the number of tokens with a strictly larger logprob at that position. Each entry lists the
chosen token first, then the top-N ids by descending logprob (the chosen token may appear
twice: first, and again among the top-N).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from sits.core.outputs import TokenLogprobs


def log_softmax_f32(logits: Tensor) -> Tensor:
    """float32 log-softmax over the vocabulary.

    Args:
        logits: [N, V] any float dtype.

    Returns:
        [N, V] float32 logprobs.
    """
    return torch.log_softmax(logits.float(), dim=-1)  # [N, V]


def gather_logprobs(
    logprobs: Tensor, token_ids: Tensor, num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Build one `TokenLogprobs` per row from a logprob matrix.

    Args:
        logprobs: [N, V] float32 logprobs.
        token_ids: [N] int64, the chosen (or actual) token of each row.
        num_top: per row, how many top alternatives to list (0..20).

    Returns:
        N entries: the row's token first, then its top-`num_top[i]` ids by descending logprob,
        with their logprobs and 1-based ranks.
    """
    num_rows = logprobs.shape[0]
    assert token_ids.shape == (num_rows,) and len(num_top) == num_rows
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [N]
    max_top = max(num_top, default=0)
    if max_top > 0:
        top_values, top_ids = logprobs.topk(max_top, dim=1)  # [N, max_top] each, descending
        top_values_list, top_ids_list = top_values.tolist(), top_ids.tolist()
    else:
        top_values_list = top_ids_list = [[] for _ in range(num_rows)]
    chosen_list = chosen.squeeze(1).tolist()
    ranks_list = ranks.tolist()
    ids_list = token_ids.tolist()
    entries: list[TokenLogprobs] = []
    for i in range(num_rows):
        k = num_top[i]
        entries.append(
            TokenLogprobs(
                token_ids=[ids_list[i]] + top_ids_list[i][:k],
                logprobs=[chosen_list[i]] + top_values_list[i][:k],
                ranks=[ranks_list[i]] + list(range(1, k + 1)),
            )
        )
    return entries


def compute_prompt_logprobs(
    logits: Tensor, target_token_ids: Tensor | Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of the actual next prompt tokens under the model.

    Args:
        logits: [N, V] logits at N prompt positions (raw; any float dtype).
        target_token_ids: [N] the prompt token that follows each position.
        num_top: top alternatives listed per position (0..20).

    Returns:
        N entries, the actual token first, then the top-`num_top` ids.
    """
    targets = torch.as_tensor(target_token_ids, dtype=torch.long, device=logits.device)  # [N]
    return gather_logprobs(log_softmax_f32(logits), targets, [num_top] * logits.shape[0])
