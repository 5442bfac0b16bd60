"""Loading with spare expert slots (`num_spare_experts`): the logical experts get exactly the
weights of a load without spares (hub per-expert files, transformers' fused in-memory names,
dummy weights), the spare slots are zero, and a missing expert still fails the load."""

from __future__ import annotations

import pytest
import torch

from sits.core.errors import UnsupportedModelError
from sits.layers.moe import SparseMoeBlock
from sits.models.loader import load_model, load_weights_from


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_logical_equal(spare_model, reference: dict[str, torch.Tensor], num_spare: int) -> None:
    blocks = [m for m in spare_model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.num_spare_experts == num_spare for b in blocks)
    for name, param in spare_model.named_parameters():
        want = reference[name]
        if name.endswith((".w13", ".w2")):
            assert param.shape[0] == want.shape[0] + num_spare
            assert torch.equal(param[: want.shape[0]], want)
            assert not param[want.shape[0] :].any()
        else:
            assert torch.equal(param, want), name


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_spare_slots_load_the_checkpoint_experts(tiny_checkpoint, arch: str) -> None:
    model_dir = str(tiny_checkpoint(arch))
    reference = _params(load_model(model_dir, torch.float32, "cpu"))
    _assert_logical_equal(
        load_model(model_dir, torch.float32, "cpu", num_spare_experts=2), reference, 2
    )


def test_spare_slots_with_fused_names_and_dummy_weights(tiny_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = str(tiny_checkpoint("qwen3_moe"))
    reference = _params(load_model(model_dir, torch.float32, "cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = load_model(model_dir, torch.float32, "cpu", num_spare_experts=1)
    load_weights_from(model, hf_model.state_dict().items())  # mlp.experts.gate_up_proj [E, ...]
    _assert_logical_equal(model, reference, 1)

    dummy = _params(load_model(model_dir, torch.float32, "cpu", load_format="dummy", seed=3))
    spare_dummy = load_model(
        model_dir, torch.float32, "cpu", load_format="dummy", seed=3, num_spare_experts=2
    )
    _assert_logical_equal(spare_dummy, dummy, 2)

    pairs = [(n, t) for n, t in hf_model.state_dict().items() if "layers.1.mlp.experts" not in n]
    assert len(pairs) < len(hf_model.state_dict())
    with pytest.raises(UnsupportedModelError, match="layers.1.mlp.w13"):
        load_weights_from(model, pairs)
