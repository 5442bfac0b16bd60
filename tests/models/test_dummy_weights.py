"""`--load-format dummy`: seeded random weights made on the device, and `load_weights_from`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, ModelNotFoundError
from sits.models.dummy import (
    DUMMY_MARKER,
    DUMMY_STD,
    ROUTER_DIMS_DIVISOR,
    dummy_tensor,
    parameter_seed,
    prepare_dummy_dir,
    read_dummy_seed,
)
from sits.models.loader import (
    build_meta_model,
    checkpoint_target,
    load_model,
    load_weights_from,
)


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dummy_weights_are_seeded_and_shaped(tiny_checkpoint) -> None:
    model_dir = str(tiny_checkpoint("qwen2"))  # has q/k/v biases and tied embeddings
    a = _params(load_model(model_dir, torch.float32, "cpu", load_format="dummy", seed=3))
    b = _params(load_model(model_dir, torch.float32, "cpu", load_format="dummy", seed=3))
    c = _params(load_model(model_dir, torch.float32, "cpu", load_format="dummy", seed=4))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)
    embed = "model.embed_tokens.weight"
    assert not torch.equal(a[embed], c[embed])
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert torch.equal(a["model.layers.0.self_attn.qkv_proj.bias"], torch.zeros(128))
    assert a[embed].std().item() == pytest.approx(DUMMY_STD, rel=0.05)
    assert a[embed].mean().item() == pytest.approx(0.0, abs=1e-3)
    # Each parameter has its own generator: rebuilt alone, it is identical.
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert torch.equal(dummy_tensor(qkv, (128, 64), torch.float32, "cpu", 3), a[qkv])
    assert parameter_seed(3, qkv) != parameter_seed(3, embed)


def test_dummy_dir_loads_dummy_weights_with_its_seed(tiny_checkpoint, tmp_path) -> None:
    source = str(tiny_checkpoint("llama"))
    dummy_dir = prepare_dummy_dir(source, seed=5, cache_dir=str(tmp_path))
    assert read_dummy_seed(dummy_dir) == 5
    assert read_dummy_seed(source) is None
    assert prepare_dummy_dir(source, seed=5, cache_dir=str(tmp_path)) == dummy_dir
    assert prepare_dummy_dir(dummy_dir, seed=5, cache_dir=str(tmp_path)) == dummy_dir
    assert sorted(p.name for p in (tmp_path).iterdir()) == [dummy_dir.rsplit("/", 1)[1]]
    auto = _params(load_model(dummy_dir, torch.float32, "cpu"))
    explicit = _params(load_model(source, torch.float32, "cpu", load_format="dummy", seed=5))
    real = _params(load_model(source, torch.float32, "cpu"))
    assert all(torch.equal(auto[n], explicit[n]) for n in auto)
    assert not torch.equal(auto["lm_head.weight"], real["lm_head.weight"])


def test_config_without_weights_names_the_dummy_format(tiny_checkpoint, tmp_path) -> None:
    source = tiny_checkpoint("llama")
    shutil.copyfile(source / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelNotFoundError, match="--load-format dummy"):
        load_model(str(tmp_path), torch.float32, "cpu")
    model = load_model(str(tmp_path), torch.float32, "cpu", load_format="dummy")
    assert torch.isfinite(model.lm_head.weight).all()
    assert not (tmp_path / DUMMY_MARKER).exists()


def test_load_format_is_validated() -> None:
    with pytest.raises(InvalidParameterError) as info:
        EngineConfig(model="m", load_format="pt")
    assert info.value.param == "load_format"
    assert EngineConfig(model="m", load_format="dummy").load_format == "dummy"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2"])
def test_load_weights_from_transformers_state_dict(tiny_checkpoint, arch: str) -> None:
    """Weights given as transformers' in-memory (name, tensor) pairs load like the files."""
    from transformers import AutoModelForCausalLM

    model_dir = str(tiny_checkpoint(arch))
    reference = _params(load_model(model_dir, torch.float32, "cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = load_model(model_dir, torch.float32, "cpu", load_format="dummy", seed=9)
    load_weights_from(model, hf_model.state_dict().items())
    loaded = _params(model)
    assert all(torch.equal(loaded[n], reference[n]) for n in reference)


def test_checkpoint_target_maps_hf_names(tiny_checkpoint) -> None:
    model = build_meta_model(str(tiny_checkpoint("qwen3_moe")))
    assert checkpoint_target(model, "model.layers.0.self_attn.k_proj.weight") == (
        "model.layers.0.self_attn.qkv_proj.weight",
        (slice(64, 96),),
    )
    assert checkpoint_target(model, "model.layers.1.mlp.experts.gate_up_proj") == (
        "model.layers.1.mlp.w13",
        (),
    )
    assert checkpoint_target(model, "model.rotary_emb.inv_freq") is None
    assert checkpoint_target(model, "model.layers.0.unknown.weight") is None


def test_dummy_moe_routes_over_every_expert_with_finite_logits(tmp_path, monkeypatch) -> None:
    from sits import LLM, SamplingParams
    from sits.bench.shapes import write_shape_dir

    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path))
    llm = LLM(
        write_shape_dir("tiny-qwen3-moe"),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
    )
    prompts = [{"prompt_token_ids": list(range(i, 512, 7))[:40]} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=2))
    for out in outs:
        for entry in out.outputs[0].logprobs:
            assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in entry.values())
    for layer in llm.engine_core.runner.model.model.layers:
        counts = layer.mlp.expert_state().num_tokens
        assert int((counts > 0).sum()) == 8  # 172 tokens x top-2 reach all 8 experts
        assert int(counts.sum()) == 2 * (4 * 40 + 4 * 3)
    assert json.loads((tmp_path / "shapes" / "tiny-qwen3-moe" / "config.json").read_text())


def test_dummy_router_reads_only_the_token_dims() -> None:
    hidden, divisor = 64, ROUTER_DIMS_DIVISOR
    o_proj = dummy_tensor("model.layers.0.self_attn.o_proj.weight", (hidden, 32), torch.float32,
                          "cpu", 0)  # fmt: skip
    w2 = dummy_tensor("model.layers.0.mlp.w2", (4, hidden, 16), torch.float32, "cpu", 0)
    gate = dummy_tensor("model.layers.0.mlp.gate.weight", (4, hidden), torch.float32, "cpu", 0)
    qkv = dummy_tensor("model.layers.0.self_attn.qkv_proj.weight", (hidden, 32), torch.float32,
                       "cpu", 0)  # fmt: skip
    k = hidden // divisor
    assert torch.count_nonzero(o_proj[:k]) == 0 and torch.count_nonzero(w2[:, :k]) == 0
    assert torch.count_nonzero(gate[:, k:]) == 0
    assert torch.count_nonzero(o_proj[k:]) == (hidden - k) * 32
    assert torch.count_nonzero(w2[:, k:]) == 4 * (hidden - k) * 16
    assert torch.count_nonzero(gate[:, :k]) == 4 * k
    assert torch.count_nonzero(qkv) == hidden * 32  # other weights are dense


def test_dummy_moe_routes_random_tokens_over_all_experts(tiny_model_factory) -> None:
    """Plain random weights send most tokens to the same few experts after the first layer
    (sits.models.dummy, "Routing"): on this model max/mean tokens per expert was 2.1-4.0 in
    every layer; the dummy weights must spread them (1.3-1.5 here)."""
    from sits.core.sampling_params import SamplingParams
    from sits.engine.llm import LLM
    from sits.runner.expert_health import ExpertMonitor

    num_experts, top_k, num_layers = 16, 2, 8
    model_dir = tiny_model_factory(
        "qwen3_moe", hidden_size=512, num_hidden_layers=num_layers, num_experts=num_experts,
        num_experts_per_tok=top_k, head_dim=64,
    )  # fmt: skip
    llm = LLM(str(model_dir), load_format="dummy", dtype="float32", max_model_len=104,
              kv_cache_memory_bytes=64 << 20)  # fmt: skip
    ids = torch.randint(1, 512, (8, 96), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([{"prompt_token_ids": p} for p in ids],
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))  # fmt: skip
    stats = ExpertMonitor.of_model(llm.engine_core.runner.model).read()
    assert len(stats.layers) == num_layers
    for layer in stats.layers:
        assert sum(layer.num_tokens) == 8 * 96 * top_k  # mean 96 per expert
        assert min(layer.num_tokens) > 0, (layer.layer_id, layer.num_tokens)
        assert layer.imbalance < 1.75, (layer.layer_id, layer.num_tokens)
