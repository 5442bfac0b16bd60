"""Tiny checkpoints: deterministic per seed, cached, special ids as the tiny tokenizer has them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sits.testing.tiny import cached_tiny_checkpoint, make_tiny_checkpoint


def test_same_seed_same_weights_and_global_rng_untouched(tmp_path) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = make_tiny_checkpoint("qwen2", tmp_path / "a", seed=3, with_tokenizer=False)
    assert torch.equal(torch.rand(1), expected_next)
    second = make_tiny_checkpoint("qwen2", tmp_path / "b", seed=3, with_tokenizer=False)
    other = make_tiny_checkpoint("qwen2", tmp_path / "c", seed=4, with_tokenizer=False)
    a, b, c = (load_file(str(d / "model.safetensors")) for d in (first, second, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    # norm weights and biases are perturbed away from HF's constant init
    norm = a["model.layers.0.input_layernorm.weight"]
    assert 0.8 <= norm.min() < norm.max() <= 1.2 and norm.std() > 0.05
    assert a["model.layers.0.self_attn.q_proj.bias"].abs().min() > 0


def test_config_and_generation_config(tmp_path) -> None:
    model_dir = make_tiny_checkpoint(
        "mixtral", tmp_path / "m", dtype=torch.bfloat16, with_tokenizer=False, vocab_size=300
    )
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["vocab_size"], config["eos_token_id"], config["bos_token_id"]) == (300, 0, None)
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0
    weights = load_file(str(model_dir / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_cached_checkpoint_is_reused_per_key(tmp_path) -> None:
    first = cached_tiny_checkpoint("llama", tmp_path, with_tokenizer=False, num_hidden_layers=1)
    again = cached_tiny_checkpoint("llama", tmp_path, with_tokenizer=False, num_hidden_layers=1)
    other = cached_tiny_checkpoint("llama", tmp_path, with_tokenizer=False)
    assert first == again != other
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_unknown_arch_is_rejected(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown tiny arch 'gpt2'"):
        make_tiny_checkpoint("gpt2", tmp_path, with_tokenizer=False)
