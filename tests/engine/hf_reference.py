"""Reference outputs from Hugging Face transformers for engine tests."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=8)
def hf_model(model_dir: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None):
    """transformers `generate` (greedy) and the chosen tokens' log-softmax values."""
    model = hf_model(model_dir)
    input_ids = torch.tensor([prompt_ids])
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = eos_id  # None: never stop early (like ignore_eos)
    config.pad_token_id = eos_id if eos_id is not None else 0
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        generation_config=config,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    tokens = out[0, len(prompt_ids) :].tolist()
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    full = torch.tensor([prompt_ids + tokens])
    logprobs = torch.log_softmax(model(full).logits[0].float(), dim=-1)  # [len, vocab]
    chosen = [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(tokens)]
    return tokens, chosen


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids (avoiding the special ids 0-2)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
