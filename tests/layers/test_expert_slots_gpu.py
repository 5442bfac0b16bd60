"""Spare expert slots on the fused CUDA path (`fused_route`, `TritonMoe`, `fused_health_update`):
the same outputs as without spares, a NaN expert frozen within three forwards and restored
into a spare slot, with the block captured in a CUDA graph before the fault and replayed
throughout (the table and the weights are switched in place).

Run on the GPU machine: `pytest -m gpu tests/layers/test_expert_slots_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from safetensors.torch import save_file  # noqa: E402

from sits.kernels.moe_triton import TritonMoe  # noqa: E402
from sits.layers.moe import MoeConfig, SparseMoeBlock  # noqa: E402
from sits.runner.expert_health import ExpertMonitor  # noqa: E402

HIDDEN, NUM_EXPERTS, NUM_SPARE = 64, 8, 2
CONFIG = MoeConfig(num_experts=NUM_EXPERTS, top_k=2, intermediate_size=32, renormalize=True)
LAYER = 0


def make_block(num_spare: int) -> SparseMoeBlock:
    block = SparseMoeBlock(HIDDEN, CONFIG, TritonMoe())
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    block.add_spare_slots(num_spare)
    return block.cuda()


def save_checkpoint(block: SparseMoeBlock, path) -> str:
    inter = CONFIG.intermediate_size
    tensors = {}
    for expert in range(NUM_EXPERTS):
        prefix = f"model.layers.{LAYER}.mlp.experts.{expert}"
        w13 = block.w13[expert].detach().cpu()
        tensors[f"{prefix}.gate_proj.weight"] = w13[:inter].contiguous()
        tensors[f"{prefix}.up_proj.weight"] = w13[inter:].contiguous()
        tensors[f"{prefix}.down_proj.weight"] = block.w2[expert].detach().cpu().contiguous()
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@torch.inference_mode()
def test_fused_path_with_spares_equals_no_spares() -> None:
    plain, spare = make_block(0), make_block(NUM_SPARE)
    for num_tokens in (1, 7, 64):
        hidden = torch.randn(num_tokens, HIDDEN, device="cuda")
        assert spare._use_fused_kernels(hidden)
        torch.testing.assert_close(spare(hidden), plain(hidden), rtol=1e-5, atol=1e-6)
    assert torch.equal(spare.expert_state().num_tokens, plain.expert_state().num_tokens)
    assert spare.expert_slots().table.tolist() == list(range(NUM_EXPERTS))
    assert not spare.expert_slots().nonfinite.any()


@torch.inference_mode()
def test_nan_expert_restored_into_a_spare_under_a_cuda_graph(tmp_path) -> None:
    block = make_block(NUM_SPARE)
    model_dir = save_checkpoint(block, tmp_path / "ckpt")
    monitor = ExpertMonitor({LAYER: block}, freeze_after=3, model_dir=model_dir, auto_restore=True)
    static_in = torch.randn(16, HIDDEN, device="cuda")
    for _ in range(2):  # warm up: kernels compiled, state and table made outside the capture
        original = block(static_in).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static_in)
    counts = monitor.read().layers[0].num_tokens
    bad = max(range(NUM_EXPERTS), key=lambda e: counts[e])

    block.w2[bad] = float("nan")
    for check in range(1, 4):
        graph.replay()
        assert not torch.isfinite(static_out).all()
        state = block.expert_state()
        assert state.num_anomalous.tolist() == [check * (e == bad) for e in range(8)]
        assert bool(state.frozen[bad]) == (check == 3)
    graph.replay()  # frozen: routed around, finite
    assert torch.isfinite(static_out).all()

    stats = monitor.read()  # restores into slot 8 and unfreezes
    assert stats.num_spare_restores == 1 and not any(stats.layers[0].frozen)
    table = [NUM_EXPERTS if e == bad else e for e in range(NUM_EXPERTS)]
    assert block.expert_slots().table.tolist() == table
    assert list(block.expert_slots().free_slots) == [NUM_EXPERTS + 1, bad]
    graph.replay()  # the captured graph reads the switched table in place
    torch.testing.assert_close(static_out, original, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(block(static_in), original, rtol=1e-5, atol=1e-6)
    assert block.expert_state().num_anomalous[bad] == 3
