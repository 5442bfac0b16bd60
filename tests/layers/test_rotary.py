"""RoPE kinds vs transformers' rotary embedding, and reading both rope config spellings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from sits.core.errors import UnsupportedModelError
from sits.layers.rotary import RopeConfig, RotaryEmbedding
from sits.models.hf_config import load_hf_config, rope_config_of

POSITIONS = torch.tensor([0, 1, 2, 7, 63, 64, 65, 500, 1023, 4095, 8191])

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "yarn-beta": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "original_max_position_embeddings": 512,
    },
    "yarn-attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "attention_factor": 1.5,
        "original_max_position_embeddings": 256,
    },
}


def llama_config(rope: dict, head_dim: int = 32) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_parameters=dict(rope),
    )


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_equal_transformers(name: str) -> None:
    config = llama_config(ROPES[name])
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), POSITIONS[None])
    ours = RotaryEmbedding(rope_config_of(config))
    assert ours.rope.rope_type == ROPES[name]["rope_type"]
    cos, sin = ours.cos_sin(POSITIONS, torch.float32)
    assert cos.shape == (len(POSITIONS), 32)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_rotated_query_and_key_equal_transformers(name: str) -> None:
    config = llama_config(ROPES[name], head_dim=16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), 4, 16, generator=gen)  # [T, H, D]
    k = torch.randn(len(POSITIONS), 2, 16, generator=gen)  # [T, K, D]
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, POSITIONS[None])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )  # [1, heads, T, D]
    ours_q, ours_k = RotaryEmbedding(rope_config_of(config))(POSITIONS, q, k)
    torch.testing.assert_close(ours_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_bfloat16_rotation_equals_transformers() -> None:
    config = llama_config(ROPES["default"], head_dim=16)
    q = torch.randn(len(POSITIONS), 4, 16).bfloat16()
    k = torch.randn(len(POSITIONS), 2, 16).bfloat16()
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, POSITIONS[None])
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin
    )
    ours_q, ours_k = RotaryEmbedding(rope_config_of(config))(POSITIONS, q, k)
    assert ours_q.dtype == torch.bfloat16
    assert torch.equal(ours_q, hf_q[0].transpose(0, 1))
    assert torch.equal(ours_k, hf_k[0].transpose(0, 1))


def test_legacy_rope_theta_and_rope_scaling_are_read() -> None:
    legacy = SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        head_dim=None,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=2048,
    )
    rope = rope_config_of(legacy)
    assert rope == RopeConfig(head_dim=16, rope_type="linear", theta=500000.0, factor=2.0)
    no_scaling = SimpleNamespace(**{**vars(legacy), "rope_scaling": None, "rope_theta": 1e6})
    assert rope_config_of(no_scaling) == RopeConfig(head_dim=16, rope_type="default", theta=1e6)


def test_legacy_config_json_is_read_through_autoconfig(tmp_path) -> None:
    config = llama_config(ROPES["default"]).to_dict()
    config.pop("rope_parameters")
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    rope = rope_config_of(load_hf_config(str(tmp_path)))
    assert (rope.rope_type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)
    assert rope.original_max_position_embeddings == 8192


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic'"),
        ({"rope_type": "longrope", "factor": 2.0}, "'longrope'"),
        ({"rope_type": "nonsense"}, "'nonsense'"),
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"rope_type": "linear"}, "needs a 'factor'"),
    ],
)
def test_unsupported_rope_is_named(params: dict, named: str) -> None:
    with pytest.raises(UnsupportedModelError, match=named):
        RopeConfig.from_dict(params, head_dim=16, max_position_embeddings=1024)
