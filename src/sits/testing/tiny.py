"""Tiny random Hugging Face checkpoints of every supported family, made locally with transformers.

Invariants:
- The same (arch, seed, dtype, overrides) gives the same weights: the random state is forked
  and seeded, and the caller's global torch RNG is left untouched.
- Weights are large enough (initializer_range 0.1) that logits are well separated, and norm
  weights and biases are perturbed away from HF's constant init (1 and 0), so a test fails if
  any of them is loaded wrongly.
- Special ids follow `sits.testing.tokenizer`: id 0 "<|endoftext|>" is EOS; no BOS.
- Checkpoints are written with `save_pretrained` (safetensors) plus a generation_config.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
EOS_TOKEN_ID = 0

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": None,
}

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": False},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True},
    "qwen3_moe": {
        "tie_word_embeddings": False,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mixtral": {
        "tie_word_embeddings": False,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
}


def _config_class(arch: str) -> Any:
    import transformers

    names = {
        "llama": "LlamaConfig",
        "qwen2": "Qwen2Config",
        "qwen3": "Qwen3Config",
        "qwen3_moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig",
    }
    return getattr(transformers, names[arch])


def tiny_config(arch: str, **config_overrides: Any) -> Any:
    """The transformers config of a tiny `arch` model (2 layers, hidden 64, vocab 512, ...).

    Raises:
        ValueError: arch is not one of TINY_ARCHS.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS}")
    kwargs = {**_COMMON, **_ARCH_DEFAULTS[arch], **config_overrides}
    return _config_class(arch)(**kwargs)


def _perturb_constant_init(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Norm weights -> U(0.8, 1.2), biases -> N(0, 0.1): nothing left at HF's 1/0 init."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                noise = torch.rand(param.shape, generator=generator) * 0.4 + 0.8
                param.copy_(noise)
            elif name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def make_tiny_checkpoint(
    arch: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random checkpoint of `arch` into directory `path`.

    Args:
        arch: one of TINY_ARCHS ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral").
        path: output directory (created).
        seed: weight seed.
        dtype: saved weight dtype.
        with_tokenizer: also save a tiny byte-level BPE tokenizer
            (`sits.testing.tokenizer.save_tiny_tokenizer`) whose vocabulary fits vocab_size.
        config_overrides: transformers config fields to change (e.g. rope_parameters,
            mlp_only_layers, tie_word_embeddings).

    Returns:
        The checkpoint directory.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = tiny_config(arch, **config_overrides)
    out_dir = Path(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed + 1)
        _perturb_constant_init(model, generator)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    if with_tokenizer:
        from sits.testing.tokenizer import save_tiny_tokenizer

        save_tiny_tokenizer(out_dir, config.vocab_size)
    return out_dir


def cached_tiny_checkpoint(
    arch: str,
    base_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """`make_tiny_checkpoint` into base_dir/<arch>-<key hash>, reusing a finished earlier one.

    The directory is written under a temporary name and renamed when complete, so a crash never
    leaves a half-written checkpoint that later calls would reuse.
    """
    key = json.dumps(
        [arch, seed, str(dtype), with_tokenizer, sorted(config_overrides.items())],
        sort_keys=True,
        default=str,
    )
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    base = Path(base_dir)
    final_dir = base / f"{arch}-{digest}"
    if final_dir.is_dir():
        return final_dir
    base.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=base))
    make_tiny_checkpoint(
        arch, tmp_dir, seed=seed, dtype=dtype, with_tokenizer=with_tokenizer, **config_overrides
    )
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir
