"""The MoE routing and health kernels on an NVIDIA GPU at the Qwen3-30B-A3B shape (E=128,
top-8), vs the PyTorch path of `ExpertState`; captured in a CUDA graph and replayed.

Expected ids come from a stable sort of the masked logits (the kernel's documented order:
descending, equal values lowest id first), since torch.topk orders equal values arbitrarily;
torch.topk itself must agree on all but a few tied rows.

Run on the GPU machine: `pytest tests/kernels -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.moe_health_triton import fused_health_update  # noqa: E402
from sits.kernels.moe_ref import TorchMoe, select_experts  # noqa: E402
from sits.kernels.moe_routing_triton import fused_route, gate_route  # noqa: E402
from sits.layers.moe import MoeConfig, SparseMoeBlock  # noqa: E402
from sits.layers.moe_stats import ExpertState  # noqa: E402

NUM_EXPERTS, TOP_K = 128, 8
FROZEN_IDS = [3, 77, 120]
NAN, INF = float("nan"), float("inf")


def make_inputs(num_tokens: int, seed: int, dtype: torch.dtype = torch.float32):
    """(logits [T, E] dtype, frozen [E] bool, token_mask [T] bool) on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, NUM_EXPERTS, generator=gen, device="cuda").to(dtype)
    frozen = torch.zeros(NUM_EXPERTS, dtype=torch.bool, device="cuda")
    frozen[FROZEN_IDS] = True
    token_mask = torch.rand(num_tokens, generator=gen, device="cuda") < 0.9
    return logits, frozen, token_mask


def stable_topk_ids(logits: torch.Tensor, frozen: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, k] int64: descending masked logit, equal values lowest expert id first."""
    masked = logits.float().masked_fill(frozen, -INF)
    return torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :top_k]


def reference_state(logits, frozen, ids, token_mask) -> ExpertState:
    """The PyTorch path's counters after one routing of `ids`."""
    state = ExpertState.zeros(NUM_EXPERTS, TOP_K, logits.device)
    state.frozen.copy_(frozen)
    state.count(ids, token_mask)
    state.mark_checked(ids, state.finite_rows(logits, token_mask))
    return state


def split_padding(weights, ids, token_mask):
    """Assert that padding rows go to no expert (ids -1, weights 0); return the real rows."""
    real = token_mask if token_mask is not None else torch.ones_like(ids[:, 0], dtype=torch.bool)
    assert (ids[~real] == -1).all() and (weights[~real] == 0).all()
    return weights[real], ids[real], real


def route(logits, frozen, token_mask, renormalize: bool):
    """fused_route on fresh counters: (weights, ids, num_tokens, checked)."""
    num_tokens = torch.zeros(NUM_EXPERTS, dtype=torch.int64, device="cuda")
    checked = torch.zeros(NUM_EXPERTS, dtype=torch.bool, device="cuda")
    weights, ids = fused_route(logits, frozen, TOP_K, renormalize, num_tokens, checked, token_mask)
    return weights, ids, num_tokens, checked


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 512, 513, 4096])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(num_tokens: int, renormalize: bool) -> None:
    logits, frozen, token_mask = make_inputs(num_tokens, seed=num_tokens)
    weights, ids, acc, checked = route(logits, frozen, token_mask, renormalize)
    expected_ids = stable_topk_ids(logits, frozen, TOP_K)
    weights, ids, real = split_padding(weights, ids, token_mask)
    assert torch.equal(ids, expected_ids[real])
    ref_weights, ref_ids = select_experts(logits.masked_fill(frozen, -INF), TOP_K, renormalize)
    torch.testing.assert_close(weights, ref_weights[real], rtol=1e-5, atol=1e-7)
    assert (ids == ref_ids[real]).all(dim=1).float().mean() >= 0.99  # torch.topk: ties aside
    ref = reference_state(logits, frozen, expected_ids, token_mask)
    assert torch.equal(acc, ref.num_tokens) and torch.equal(checked, ref.checked)
    assert int(acc.sum()) == int(token_mask.sum()) * TOP_K
    assert not acc[FROZEN_IDS].any()


@pytest.mark.parametrize("num_tokens", [1, 37, 2048])
def test_route_bfloat16_logits_with_ties(num_tokens: int) -> None:
    logits, frozen, token_mask = make_inputs(num_tokens, seed=5, dtype=torch.bfloat16)
    weights, ids, acc, checked = route(logits, frozen, token_mask, renormalize=True)
    expected_ids = stable_topk_ids(logits, frozen, TOP_K)
    weights, ids, real = split_padding(weights, ids, token_mask)
    assert torch.equal(ids, expected_ids[real])
    probs = torch.softmax(logits.float().masked_fill(frozen, -INF), dim=-1)  # [T, E]
    expected = probs.gather(1, expected_ids)
    expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, expected[real], rtol=1e-5, atol=1e-7)
    ref = reference_state(logits, frozen, expected_ids, token_mask)
    assert torch.equal(acc, ref.num_tokens) and torch.equal(checked, ref.checked)


def test_nonfinite_rows_routed_to_lowest_unfrozen_and_not_checked() -> None:
    logits, frozen, _ = make_inputs(16, seed=2)
    logits[:, :5] -= 20.0  # experts 0-4: never chosen by a finite row
    logits[4, 9] = NAN
    logits[7, 100] = INF
    logits[9, 3] = NAN  # a frozen expert's logit only: the row stays finite
    weights, ids, acc, checked = route(logits, frozen, None, renormalize=True)
    assert ids[[4, 7]].tolist() == [[0, 1, 2, 4, 5, 6, 7, 8]] * 2
    assert weights[[4, 7]].isnan().all() and not weights[9].isnan().any()
    finite = torch.tensor([r for r in range(16) if r not in (4, 7)], device="cuda")
    assert torch.equal(ids[finite], stable_topk_ids(logits[finite], frozen, TOP_K))
    assert not checked[:5].any() and int(acc[:5].sum()) == 2 * 4
    ref = reference_state(logits, frozen, ids, None)
    assert torch.equal(acc, ref.num_tokens) and torch.equal(checked, ref.checked)


def test_health_update_matches_reference() -> None:
    gen = torch.Generator(device="cuda").manual_seed(9)
    ref = ExpertState.zeros(NUM_EXPERTS, TOP_K, torch.device("cuda"))
    ref.set_freeze_after(2)
    for _ in range(6):
        ref.checked.copy_(torch.rand(NUM_EXPERTS, generator=gen, device="cuda") < 0.6)
        ref.anomalous.copy_(torch.rand(NUM_EXPERTS, generator=gen, device="cuda") < 0.5)
        got = [
            t.clone()
            for t in (ref.checked, ref.anomalous, ref.num_anomalous, ref.streak, ref.frozen)
        ]
        fused_health_update(*got, TOP_K, ref.freeze_after)
        ref.update_health()
        for tensor, want in zip(
            got,
            (ref.checked, ref.anomalous, ref.num_anomalous, ref.streak, ref.frozen),
            strict=True,
        ):
            assert torch.equal(tensor, want)
    assert 0 < int(ref.frozen.sum()) <= NUM_EXPERTS - TOP_K


def test_cuda_graph_capture_and_replay() -> None:
    num_tokens, bad = 64, 42
    static_logits = torch.zeros(num_tokens, NUM_EXPERTS, device="cuda")
    token_mask = torch.ones(num_tokens, dtype=torch.bool, device="cuda")
    token_mask[-5:] = False  # padding rows of a decode graph
    flags = torch.zeros(NUM_EXPERTS, dtype=torch.bool, device="cuda")  # experts' stand-in
    state = ExpertState.zeros(NUM_EXPERTS, TOP_K, torch.device("cuda"))
    state.set_freeze_after(0)  # disabled at capture time

    def step():
        weights, ids = fused_route(
            static_logits, state.frozen, TOP_K, True, state.num_tokens, state.checked, token_mask
        )
        state.anomalous |= flags  # what the experts' non-finite check does
        fused_health_update(
            state.checked, state.anomalous, state.num_anomalous, state.streak, state.frozen,
            TOP_K, state.freeze_after,
        )  # fmt: skip
        return weights, ids

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    for tensor in (state.num_tokens, state.num_anomalous, state.streak, state.checked):
        tensor.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = step()

    state.set_freeze_after(2)  # after the capture: the graph reads it from the device
    ref = ExpertState.zeros(NUM_EXPERTS, TOP_K, torch.device("cuda"))
    ref.set_freeze_after(2)
    for replay in range(4):
        logits, _, _ = make_inputs(num_tokens, seed=100 + replay)
        logits[:, bad] += 6.0  # every token picks `bad` while it is not frozen
        static_logits.copy_(logits)
        flags.fill_(False)
        flags[bad] = replay < 3
        graph.replay()
        expected_ids = stable_topk_ids(logits, ref.frozen, TOP_K)
        real_weights, real_ids, real = split_padding(weights, ids, token_mask)
        assert torch.equal(real_ids, expected_ids[real]), replay
        ref_weights, _ = select_experts(logits.masked_fill(ref.frozen, -INF), TOP_K, True)
        torch.testing.assert_close(real_weights, ref_weights[real], rtol=1e-5, atol=1e-7)
        ref.count(expected_ids, token_mask)
        ref.mark_checked(expected_ids, ref.finite_rows(logits, token_mask))
        ref.anomalous |= flags
        ref.update_health()
        for name in ("num_tokens", "num_anomalous", "streak", "frozen", "checked", "anomalous"):
            assert torch.equal(getattr(state, name), getattr(ref, name)), (replay, name)
        assert bool(state.frozen[bad]) == (replay >= 1)
    assert int(state.num_anomalous[bad]) == 2  # flags while frozen: no check, not counted
    assert int(state.num_tokens[bad]) == 2 * (num_tokens - 5)


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_gate_route_equals_the_gate_then_fused_route_in_a_graph(num_tokens: int) -> None:
    """bf16 at the Qwen3-30B-A3B shape (H=2048): the one-launch router GEMV + routing equals
    cuBLAS's logits fed to `fused_route` on every row whose top k + 1 logits are distinct
    after rounding (a logit may differ by one unit in the last place), captured in a CUDA
    graph and replayed on new inputs, the counters included."""
    hidden_size = 2048
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    gate = (torch.randn(NUM_EXPERTS, hidden_size, generator=gen, device="cuda") * 0.02).bfloat16()
    static_hidden = torch.zeros(num_tokens, hidden_size, dtype=torch.bfloat16, device="cuda")
    frozen = torch.zeros(NUM_EXPERTS, dtype=torch.bool, device="cuda")
    frozen[FROZEN_IDS] = True
    arrivals = torch.zeros(1, dtype=torch.int32, device="cuda")
    state = ExpertState.zeros(NUM_EXPERTS, TOP_K, torch.device("cuda"))
    ref = ExpertState.zeros(NUM_EXPERTS, TOP_K, torch.device("cuda"))

    def step():
        return gate_route(
            static_hidden, gate, arrivals, frozen, TOP_K, True, state.num_tokens, state.checked
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    state.num_tokens.zero_()
    state.checked.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = step()
    for replay in range(3):
        hidden = torch.randn(num_tokens, hidden_size, generator=gen, device="cuda").bfloat16()
        static_hidden.copy_(hidden)
        graph.replay()
        logits = torch.nn.functional.linear(hidden, gate)  # [T, E] bf16, cuBLAS
        ref_weights, ref_ids = fused_route(logits, frozen, TOP_K, True, ref.num_tokens, ref.checked)
        top = logits.float().masked_fill(frozen, -INF).sort(dim=-1, descending=True).values
        distinct = (top[:, : TOP_K + 1].diff(dim=-1) != 0).all(dim=-1)  # [T]
        assert int(distinct.sum()) >= num_tokens // 2, replay
        assert torch.equal(ids[distinct], ref_ids[distinct]), replay
        torch.testing.assert_close(weights, ref_weights, rtol=2e-2, atol=1e-3)
        assert int(arrivals) == 0
        assert int(state.num_tokens.sum()) == (replay + 1) * num_tokens * TOP_K
        if bool(distinct.all()):
            assert torch.equal(state.num_tokens, ref.num_tokens), replay


@torch.no_grad()
@pytest.mark.parametrize("num_tokens", [7, 33])  # gate_route, then the gate GEMM + fused_route
def test_sparse_moe_block_fused_path_equals_torch_path(num_tokens: int) -> None:
    torch.manual_seed(0)
    config = MoeConfig(NUM_EXPERTS, TOP_K, intermediate_size=32, renormalize=True)
    fused = SparseMoeBlock(64, config, TorchMoe()).cuda()
    for param in fused.parameters():
        param.normal_(std=0.2)
    reference = SparseMoeBlock(64, config, TorchMoe()).cuda()
    reference.load_state_dict(fused.state_dict())
    reference.fused_routing = False
    assert fused._use_fused_kernels(torch.empty(1, device="cuda"))
    hidden = torch.randn(num_tokens, 64, device="cuda")
    token_mask = torch.ones(num_tokens, dtype=torch.bool, device="cuda")
    token_mask[-3:] = False
    bad = int(torch.bincount(select_experts(fused.gate(hidden), TOP_K, True)[1].flatten()).argmax())
    fused.w2[bad, 5] = NAN
    reference.w2[bad, 5] = NAN
    for step in range(4):
        out, ref_out = fused(hidden, token_mask), reference(hidden, token_mask)
        torch.testing.assert_close(
            out[token_mask], ref_out[token_mask], rtol=1e-5, atol=1e-5, equal_nan=True
        )
        assert not out[~token_mask].any()  # padding rows: no expert ran, zeros
        got, want = fused.expert_state(), reference.expert_state()
        for name in ("num_tokens", "num_anomalous", "streak", "frozen", "checked", "anomalous"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        assert bool(got.frozen[bad]) == (step >= 2)
    assert torch.isfinite(out).all()
