"""Loading checkpoints: shard layouts, expert weight formats, dtype, and every error path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config

from sits.core.errors import ModelNotFoundError, UnsupportedModelError
from sits.layers.mlp import GatedMLP
from sits.layers.moe import SparseMoeBlock
from sits.models.loader import load_model, resolve_model_path
from sits.models.registry import supported_architectures
from tests.models.paged import PagedRunner

SUPPORTED = [
    "LlamaForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]
PROMPT = [5, 77, 300, 12, 9, 480, 31, 64, 200, 3, 17]


def prompt_logits(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = load_model(str(model_dir), dtype, "cpu")
    return PagedRunner(model).step([("a", PROMPT)])[0]


def copy_checkpoint(src: Path, dst: Path, *, weights: dict[str, torch.Tensor]) -> Path:
    """A copy of src's config files with `weights` as its single model.safetensors."""
    dst.mkdir()
    for path in src.glob("*.json"):
        if path.name != "model.safetensors.index.json":
            shutil.copy(path, dst / path.name)
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_registry_lists_the_supported_architectures() -> None:
    assert supported_architectures() == SUPPORTED


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_sharded_checkpoint_gives_the_same_logits(tiny_checkpoint, tmp_path, arch, capsys) -> None:
    single = tiny_checkpoint(arch)
    hf = AutoModelForCausalLM.from_pretrained(str(single), dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    num_shards = len(set(index["weight_map"].values()))
    assert num_shards >= 3
    capsys.readouterr()
    sharded_logits = prompt_logits(sharded)
    last_bar = capsys.readouterr().err.split("\r")[-1]
    assert last_bar.startswith("Loading safetensors checkpoint shards: 100%")
    assert f" {num_shards}/{num_shards} " in last_bar
    single_logits = prompt_logits(single)
    assert capsys.readouterr().err == ""  # one file: no bar
    assert torch.equal(sharded_logits, single_logits)


EXPERT_NAMES = {
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "block_sparse_moe": ("w1", "w3", "w2"),
}


def fuse_experts(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Per-expert hub tensors -> transformers' in-memory fused layout under `mlp.experts`."""
    fused = dict(weights)
    for layer in range(2):
        base = f"model.layers.{layer}.{prefix}"
        gate, up, down = (
            torch.stack([fused.pop(f"{base}.experts.{e}.{name}.weight") for e in range(8)])
            for name in EXPERT_NAMES[prefix]
        )
        out = f"model.layers.{layer}.mlp"
        fused[f"{out}.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
        fused[f"{out}.experts.down_proj"] = down  # [E, H, I]
        fused[f"{out}.gate.weight"] = fused.pop(f"{base}.gate.weight")
    return fused


def split_experts(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of `fuse_experts`: fused tensors -> per-expert hub names under `prefix`."""
    split = dict(weights)
    gate_name, up_name, down_name = EXPERT_NAMES[prefix]
    for layer in range(2):
        base, out = f"model.layers.{layer}.mlp", f"model.layers.{layer}.{prefix}"
        gate, up = split.pop(f"{base}.experts.gate_up_proj").chunk(2, dim=1)
        down = split.pop(f"{base}.experts.down_proj")
        for e in range(8):
            split[f"{out}.experts.{e}.{gate_name}.weight"] = gate[e].contiguous()
            split[f"{out}.experts.{e}.{up_name}.weight"] = up[e].contiguous()
            split[f"{out}.experts.{e}.{down_name}.weight"] = down[e].contiguous()
        split[f"{out}.gate.weight"] = split.pop(f"{base}.gate.weight")
    return split


@pytest.mark.parametrize(
    ("arch", "prefix"), [("qwen3_moe", "mlp"), ("mixtral", "block_sparse_moe")]
)
def test_both_expert_formats_give_transformers_logits(tiny_checkpoint, tmp_path, arch, prefix):
    saved = tiny_checkpoint(arch)
    weights = load_file(str(saved / "model.safetensors"))
    if "model.layers.0.mlp.experts.gate_up_proj" in weights:  # saved fused (older transformers 5)
        per_expert, fused = split_experts(weights, prefix), weights
    else:  # saved with hub names (transformers 5.24 save_pretrained)
        per_expert, fused = weights, fuse_experts(weights, prefix)
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert f"model.layers.1.{prefix}.experts.7.{EXPERT_NAMES[prefix][2]}.weight" in per_expert
    hf = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    for name, tensors in (("per_expert", per_expert), ("fused", fused)):
        model_dir = copy_checkpoint(saved, tmp_path / name, weights=tensors)
        torch.testing.assert_close(prompt_logits(model_dir), expected, atol=1e-4, rtol=0)


def test_qwen3_moe_dense_layers_follow_the_config(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint(
        "qwen3_moe", mlp_only_layers=[0], norm_topk_prob=False, attention_bias=True
    )
    model = load_model(str(model_dir), torch.float32, "cpu")
    assert isinstance(model.model.layers[0].mlp, GatedMLP)
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)  # 2 * intermediate
    moe = model.model.layers[1].mlp
    assert isinstance(moe, SparseMoeBlock)
    assert (moe.config.num_experts, moe.config.top_k, moe.config.renormalize) == (8, 2, False)
    assert moe.w13.shape == (8, 64, 64) and moe.w2.shape == (8, 64, 32)

    sparse_step = load_model(
        str(tiny_checkpoint("qwen3_moe", decoder_sparse_step=2)), torch.float32, "cpu"
    )
    layers = sparse_step.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, SparseMoeBlock]


def test_fused_parameters_hold_the_checkpoint_tensors(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("mixtral")
    weights = load_file(str(model_dir / "model.safetensors"))
    if "model.layers.0.mlp.experts.gate_up_proj" in weights:  # saved fused (older transformers 5)
        weights = split_experts(weights, "block_sparse_moe")
    model = load_model(str(model_dir), torch.float32, "cpu")
    attn = model.model.layers[1].self_attn
    k = weights["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(attn.qkv_proj.weight[64:96], k)
    moe = model.model.layers[1].mlp
    expert = "model.layers.1.block_sparse_moe.experts.5"
    assert torch.equal(moe.w13[5, :32], weights[f"{expert}.w1.weight"])  # gate rows first
    assert torch.equal(moe.w13[5, 32:], weights[f"{expert}.w3.weight"])
    assert torch.equal(moe.w2[5], weights[f"{expert}.w2.weight"])


def test_tied_embeddings_share_one_parameter(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("qwen2")
    assert "lm_head.weight" not in load_file(str(model_dir / "model.safetensors"))
    model = load_model(str(model_dir), torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.arch.num_layers == 2 and model.arch.num_kv_heads == 2 and model.arch.head_dim == 16


def test_bfloat16_load_matches_float32_closely(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("qwen3")
    model = load_model(str(model_dir), torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    runner = PagedRunner(model)
    runner.kv_caches = [cache.to(torch.bfloat16) for cache in runner.kv_caches]
    low = runner.step([("a", PROMPT)])[0]
    assert low.dtype == torch.float32
    assert (low - prompt_logits(model_dir)).abs().max() < 0.1


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("llama")
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.self_attn.v_proj.weight"]
    broken = copy_checkpoint(src, tmp_path / "broken", weights=weights)
    with pytest.raises(
        UnsupportedModelError, match=r"missing \[model\.layers\.1\.self_attn\.qkv_proj\.weight\]"
    ):
        load_model(str(broken), torch.float32, "cpu")


def test_unexpected_tensor_is_named(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("qwen3_moe")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)  # no expert 8
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # no q bias in the config
    broken = copy_checkpoint(src, tmp_path / "broken", weights=weights)
    with pytest.raises(
        UnsupportedModelError, match=r"unexpected \[.*experts\.8\.up_proj.*q_proj\.bias"
    ):
        load_model(str(broken), torch.float32, "cpu")


def test_misshapen_tensor_is_named(tiny_checkpoint, tmp_path) -> None:
    src = tiny_checkpoint("qwen2")
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(16)
    broken = copy_checkpoint(src, tmp_path / "broken", weights=weights)
    with pytest.raises(
        UnsupportedModelError, match=r"k_proj\.bias has shape \(16,\), expected \(32,\)"
    ):
        load_model(str(broken), torch.float32, "cpu")


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedModelError) as info:
        load_model(str(tmp_path), torch.float32, "cpu")
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in SUPPORTED)


@pytest.mark.parametrize(
    ("arch", "overrides", "named"),
    [
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
            "sliding_window=16",
        ),
        ("mixtral", {"sliding_window": 64}, "sliding_window=64"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "'dynamic'",
        ),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_option_is_named(tiny_checkpoint, arch, overrides, named) -> None:
    model_dir = tiny_checkpoint(arch, **overrides)
    with pytest.raises(UnsupportedModelError, match=named):
        load_model(str(model_dir), torch.float32, "cpu")


def test_sliding_window_longer_than_the_context_is_accepted(tiny_checkpoint) -> None:
    model_dir = tiny_checkpoint("mixtral", sliding_window=1024)  # = max_position_embeddings
    assert load_model(str(model_dir), torch.float32, "cpu").num_layers == 2


def test_resolve_model_path(tmp_path, monkeypatch) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ModelNotFoundError, match="not a checkpoint directory"):
        resolve_model_path(str(tmp_path / "absent"))
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(
        ModelNotFoundError, match="no-such-org/no-such-model.*network is unreachable"
    ):
        resolve_model_path("no-such-org/no-such-model")


def test_directory_without_weights_or_config(tmp_path, tiny_checkpoint) -> None:
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path), torch.float32, "cpu")
    src = tiny_checkpoint("llama")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_model(str(tmp_path), torch.float32, "cpu")
