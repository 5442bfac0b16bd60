"""`TritonMoe` on an NVIDIA GPU in bfloat16 at real shapes, vs the PyTorch reference.

Shapes: Qwen3-30B-A3B (E=128, H=2048, I=768, top-8) and Mixtral-8x7B (E=8, H=4096, I=14336,
top-2), one token to prefill sizes, with the tuned configs (or the default) and both row-block
sizes; a call captured in a CUDA graph and replayed on new inputs and routing; the non-finite
flags; and an expert frozen through a `SparseMoeBlock` running on `TritonMoe`.

Run on the GPU machine: `pytest tests/kernels -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.moe_config import default_config  # noqa: E402
from sits.kernels.moe_ref import TorchMoe, moe_forward, select_experts  # noqa: E402
from sits.kernels.moe_triton import TritonMoe, fused_moe  # noqa: E402
from sits.layers.moe import MoeConfig, SparseMoeBlock  # noqa: E402

DTYPE = torch.bfloat16
SHAPES = {"qwen3": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}  # E, k, H, I


@pytest.fixture(scope="module", params=sorted(SHAPES))
def weights(request):
    """(name, w13, w2) in bf16 on the GPU, scaled so activations stay O(1)."""
    num_experts, _, hidden, inter = SHAPES[request.param]
    gen = torch.Generator(device="cuda").manual_seed(11)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device="cuda", dtype=DTYPE)
    w13.mul_(hidden**-0.5)
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device="cuda", dtype=DTYPE)
    w2.mul_(inter**-0.5)
    return request.param, w13, w2


def routed_inputs(name: str, num_tokens: int, seed: int):
    """(hidden [T, H] bf16, topk_weights, topk_ids) with softmax top-k routing."""
    num_experts, top_k, hidden, _ = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda", dtype=DTYPE)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, weights, ids


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 512, 2048])
@pytest.mark.parametrize("config_kind", ["tuned", "default"])
def test_bf16_matches_reference(weights, num_tokens: int, config_kind: str) -> None:
    name, w13, w2 = weights
    num_experts, top_k, _, _ = SHAPES[name]
    x, topk_weights, topk_ids = routed_inputs(name, num_tokens, seed=num_tokens)
    backend = TritonMoe(default_config(num_tokens, top_k, num_experts))
    if config_kind == "tuned":
        backend = TritonMoe()
    out = backend.experts(x, w13, w2, topk_weights, topk_ids)
    reference = moe_forward(x, w13, w2, topk_weights, topk_ids)  # bf16 expert outputs
    exact = moe_forward(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert out.dtype == DTYPE and out.shape == x.shape and torch.isfinite(out).all()
    assert relative_error(out, reference) < 1e-2
    # At least as accurate as the reference (both round the expert outputs to bf16).
    assert relative_error(out, exact) <= 1.2 * relative_error(reference, exact) + 1e-3


@pytest.mark.parametrize("num_tokens", [1, 256])
def test_cuda_graph_replay_matches_eager(weights, num_tokens: int) -> None:
    name, w13, w2 = weights
    num_experts = SHAPES[name][0]
    backend = TritonMoe()
    x, topk_weights, topk_ids = routed_inputs(name, num_tokens, seed=1)
    flags = torch.zeros(num_experts, dtype=torch.bool, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        backend.experts(x, w13, w2, topk_weights, topk_ids, flags)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = backend.experts(x, w13, w2, topk_weights, topk_ids, flags)
    for seed in (2, 3):
        new_x, new_weights, new_ids = routed_inputs(name, num_tokens, seed=seed)
        x.copy_(new_x)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        graph.replay()
        eager = backend.experts(new_x, w13, w2, new_weights, new_ids)
        assert torch.equal(graph_out, eager)
        reference = moe_forward(new_x, w13, w2, new_weights, new_ids)
        assert relative_error(graph_out, reference) < 1e-2
    assert not flags.any()


def test_nonfinite_flags_on_gpu(weights) -> None:
    name, w13, w2 = weights
    num_experts = SHAPES[name][0]
    x, topk_weights, topk_ids = routed_inputs(name, 32, seed=4)
    bad = int(topk_ids[0, 0])
    poisoned_row = int((topk_ids != bad).all(dim=1).nonzero()[0])  # a row not routed to bad
    x[poisoned_row, 0] = float("nan")
    saved = w2[bad, 7].clone()
    w2[bad, 7] = float("inf")  # output column 7 of expert `bad` overflows
    try:
        flags = torch.zeros(num_experts, dtype=torch.bool, device="cuda")
        ref_flags = torch.zeros_like(flags)
        out = TritonMoe().experts(x, w13, w2, topk_weights, topk_ids, flags)
        expected = moe_forward(x, w13, w2, topk_weights, topk_ids, ref_flags)
    finally:
        w2[bad, 7] = saved
    assert torch.equal(flags, ref_flags)
    assert flags.nonzero().flatten().tolist() == [bad]
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))


@pytest.mark.parametrize("fused_routing", [False, True])
def test_expert_frozen_through_sparse_moe_block(fused_routing: bool) -> None:
    torch.manual_seed(0)
    num_experts, hidden = 8, 256
    config = MoeConfig(num_experts=num_experts, top_k=2, intermediate_size=128, renormalize=True)
    block = SparseMoeBlock(hidden, config, moe_backend=TritonMoe()).to("cuda", DTYPE)
    reference = SparseMoeBlock(hidden, config, moe_backend=TorchMoe()).to("cuda", DTYPE)
    if hasattr(block, "fused_routing"):  # the block's Triton routing path, or its PyTorch one
        block.fused_routing = fused_routing
        reference.fused_routing = False
    elif fused_routing:
        pytest.skip("this SparseMoeBlock has no fused routing path")
    bad = 5
    with torch.no_grad():
        block.w13.normal_(std=hidden**-0.5)
        block.w2.normal_(std=128**-0.5)
        block.gate.weight.normal_(std=0.02)
        block.gate.weight[bad] = 0.5  # positive inputs: expert `bad` wins every token
        block.w2[bad, 3] = float("nan")
        reference.load_state_dict(block.state_dict())
        x = torch.rand(16, hidden, device="cuda", dtype=DTYPE)
        for step in range(1, 4):
            out = block(x)
            state = block.expert_state()
            assert not torch.isfinite(out).all()
            assert state.num_anomalous.tolist() == [step if e == bad else 0 for e in range(8)]
            assert state.frozen.tolist() == [step == 3 and e == bad for e in range(8)]
        routed_before = int(state.num_tokens[bad])
        out = block(x)  # routed around the frozen expert
        assert torch.isfinite(out).all()
        assert int(block.expert_state().num_tokens[bad]) == routed_before
        reference.expert_state().frozen.copy_(block.expert_state().frozen)
        assert relative_error(out, reference(x)) < 1e-2


def test_fused_moe_without_flags_and_strided_hidden(weights) -> None:
    name, w13, w2 = weights
    x, topk_weights, topk_ids = routed_inputs(name, 8, seed=9)
    wide = torch.cat([x, x], dim=1)[:, : x.shape[1]]  # row stride 2H
    config = default_config(8, SHAPES[name][1], SHAPES[name][0])
    out = fused_moe(wide, w13, w2, topk_weights, topk_ids, config)
    assert torch.equal(out, fused_moe(x, w13, w2, topk_weights, topk_ids, config))
