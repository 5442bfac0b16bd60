"""The MoE routing and health kernels vs the PyTorch path of `ExpertState` (CPU interpreter).

References: `ExpertState.mask_logits` -> `moe_ref.select_experts` -> `ExpertState.count` ->
`ExpertState.mark_checked` for `fused_route`; `ExpertState.update_health` for
`fused_health_update`; and a `SparseMoeBlock` run on both paths step by step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.moe_health_triton import fused_health_update  # noqa: E402
from sits.kernels.moe_ref import select_experts  # noqa: E402
from sits.kernels.moe_routing_triton import fused_route, gate_route  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402
from sits.layers.moe import MoeConfig, SparseMoeBlock  # noqa: E402
from sits.layers.moe_stats import ExpertState  # noqa: E402

if not kernels_interpreted():
    pytest.skip("CPU interpreter tests (the GPU file covers CUDA)", allow_module_level=True)

NAN, INF = float("nan"), float("inf")
NAN_WARNINGS = pytest.mark.filterwarnings(  # numpy, inside the interpreter, on NaN rows
    "ignore:invalid value:RuntimeWarning", "ignore:All-NaN slice:RuntimeWarning"
)


def distinct_logits(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[T, E] float32 rows of distinct values, exact in float16 (no ties in any dtype)."""
    perms = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])
    return (perms.float() - num_experts / 2) * 0.0625  # [T, E]


def reference_route(logits, frozen, top_k, renormalize, token_mask, num_tokens, checked):
    """The PyTorch path on copies of the counters: (weights, ids, num_tokens, checked)."""
    state = ExpertState.zeros(frozen.numel(), top_k, logits.device)
    state.frozen.copy_(frozen)
    state.num_tokens.copy_(num_tokens)
    state.checked.copy_(checked.bool())
    weights, ids = select_experts(state.mask_logits(logits), top_k, renormalize)
    state.count(ids, token_mask)
    state.mark_checked(ids, state.finite_rows(logits, token_mask))
    return weights, ids, state.num_tokens, state.checked


def stable_topk_ids(logits: torch.Tensor, frozen: torch.Tensor, top_k: int) -> torch.Tensor:
    """The kernel's order: descending masked logit, equal values lowest expert id first."""
    masked = logits.float().masked_fill(frozen, -INF)
    return torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :top_k]


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_tokens", "renormalize", "block_tokens", "dtype", "checked_dtype"),
    [
        (8, 2, 13, True, 1, torch.float32, torch.bool),
        (60, 4, 11, False, 4, torch.float16, torch.int32),
        (128, 8, 9, True, None, torch.float32, torch.bool),
        (256, 16, 5, False, 2, torch.float32, torch.bool),
    ],
)
def test_route_matches_reference(
    num_experts, top_k, num_tokens, renormalize, block_tokens, dtype, checked_dtype
) -> None:
    gen = torch.Generator().manual_seed(num_experts + top_k)
    wide = torch.randn(num_tokens, num_experts + 3, generator=gen)
    wide[:, :num_experts] = distinct_logits(num_tokens, num_experts, gen)
    logits = wide.to(dtype)[:, :num_experts]  # rows strided by E + 3
    frozen = torch.zeros(num_experts, dtype=torch.bool)
    frozen[torch.randperm(num_experts, generator=gen)[: min(num_experts // 4, 5)]] = True
    token_mask = torch.rand(num_tokens, generator=gen) < 0.7
    token_mask[0] = False
    acc = torch.randint(0, 50, (num_experts,), generator=gen)
    acc_before = acc.clone()
    checked = torch.zeros(num_experts, dtype=checked_dtype)
    checked[1] = 1  # set by an earlier call of the forward: never cleared here

    ref_weights, ref_ids, ref_acc, ref_checked = reference_route(
        logits, frozen, top_k, renormalize, token_mask, acc, checked
    )
    weights, ids = fused_route(
        logits, frozen, top_k, renormalize, acc, checked, token_mask, block_tokens=block_tokens
    )
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    real = token_mask  # padding tokens go to no expert: ids -1, weights 0
    assert (ids[~real] == -1).all() and (weights[~real] == 0).all()
    assert torch.equal(ids[real], ref_ids[real])
    assert torch.equal(ids[real], stable_topk_ids(logits, frozen, top_k)[real])
    assert not frozen[ids[real]].any()
    torch.testing.assert_close(weights[real], ref_weights[real], rtol=2e-6, atol=1e-7)
    assert torch.equal(acc, ref_acc)
    assert torch.equal(checked.bool(), ref_checked)
    assert int((acc - acc_before).sum()) == int(token_mask.sum()) * top_k
    assert int(checked.sum()) > 1  # real tokens reached experts


@pytest.mark.parametrize(
    ("num_experts", "top_k", "num_tokens", "hidden_size", "renormalize", "dtype", "masked"),
    [
        (128, 8, 1, 256, True, torch.float32, False),
        (8, 2, 5, 96, True, torch.float16, True),  # H not a multiple of the 512-column step
        (60, 4, 16, 1024, False, torch.float16, True),  # bf16: the GPU file
    ],
)
def test_gate_route_equals_gate_then_route(
    num_experts, top_k, num_tokens, hidden_size, renormalize, dtype, masked
) -> None:
    """The router GEMV + routing launch equals nn.Linear's logits (rounded to the dtype) fed
    to `fused_route`: integer-valued inputs make the float32 sums exact in any order, so the
    two agree bit for bit (ties included: both take the lowest id first). Twice in a row:
    the arrival counter returns to zero and the counters add up."""
    gen = torch.Generator().manual_seed(num_experts * num_tokens)
    hidden = torch.randint(-3, 4, (num_tokens, hidden_size), generator=gen).to(dtype)
    gate = (torch.randint(-3, 4, (num_experts, hidden_size), generator=gen) / 16).to(dtype)
    frozen = torch.zeros(num_experts, dtype=torch.bool)
    frozen[3] = True
    token_mask = None
    if masked:
        token_mask = torch.ones(num_tokens, dtype=torch.bool)
        token_mask[1] = False
    logits = (hidden.double() @ gate.double().T).to(dtype)  # exact sums, then the gate's dtype
    acc_ref = torch.zeros(num_experts, dtype=torch.int64)
    checked_ref = torch.zeros(num_experts, dtype=torch.bool)
    acc = acc_ref.clone()
    checked = checked_ref.clone()
    arrivals = torch.zeros(1, dtype=torch.int32)
    for _ in range(2):
        ref_weights, ref_ids = fused_route(
            logits, frozen, top_k, renormalize, acc_ref, checked_ref, token_mask
        )
        weights, ids = gate_route(
            hidden, gate, arrivals, frozen, top_k, renormalize, acc, checked, token_mask
        )
        assert torch.equal(ids, ref_ids)
        assert torch.equal(weights, ref_weights)
        assert int(arrivals) == 0
    assert torch.equal(acc, acc_ref) and torch.equal(checked, checked_ref)
    real = num_tokens - (1 if masked else 0)
    assert int(acc.sum()) == 2 * real * top_k
    assert not frozen[ids[ids >= 0]].any()


def test_route_counts_every_token_without_mask() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = distinct_logits(6, 16, gen)
    frozen = torch.zeros(16, dtype=torch.bool)
    acc = torch.zeros(16, dtype=torch.int64)
    checked = torch.zeros(16, dtype=torch.bool)
    _, ids = fused_route(logits, frozen, 3, True, acc, checked)
    assert torch.equal(acc, torch.bincount(ids.flatten(), minlength=16))
    assert int(acc.sum()) == 18
    assert checked.tolist() == [bool(n) for n in acc.tolist()]


def test_equal_logits_go_lowest_expert_id_first() -> None:
    # torch.topk returns equal values in no fixed order; the kernel's rule is the stable one.
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 1.0], [2.0] * 6])
    frozen = torch.tensor([False, False, True, False, False, False])
    acc = torch.zeros(6, dtype=torch.int64)
    weights, ids = fused_route(logits, frozen, 4, False, acc, torch.zeros(6, dtype=torch.bool))
    assert ids.tolist() == [[1, 4, 0, 5], [0, 1, 3, 4]]
    assert torch.equal(ids, stable_topk_ids(logits, frozen, 4))
    masked = logits.masked_fill(frozen, -INF)
    torch.testing.assert_close(weights, torch.softmax(masked, -1).gather(1, ids))


@NAN_WARNINGS
def test_nonfinite_rows_are_routed_but_not_checked() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = distinct_logits(6, 8, gen)
    logits[:, 1:3] = -10.0 - torch.rand(6, 2, generator=gen)  # experts 1, 2: last choices
    frozen = torch.zeros(8, dtype=torch.bool)
    frozen[0] = True
    logits[1, 5] = NAN
    logits[3, 6] = INF
    logits[4, 0] = NAN  # only the frozen expert's logit: a finite row
    acc = torch.zeros(8, dtype=torch.int64)
    checked = torch.zeros(8, dtype=torch.bool)
    weights, ids = fused_route(logits, frozen, 2, True, acc, checked)

    assert ids[[1, 3]].tolist() == [[1, 2], [1, 2]]  # lowest-id unfrozen experts
    assert weights[[1, 3]].isnan().all()
    finite = torch.tensor([0, 2, 4, 5])
    ref_weights, ref_ids = select_experts(logits[finite].masked_fill(frozen, -INF), 2, True)
    assert torch.equal(ids[finite], ref_ids)
    torch.testing.assert_close(weights[finite], ref_weights, rtol=2e-6, atol=1e-7)
    expected = torch.bincount(ref_ids.flatten(), minlength=8)
    assert not expected[1:3].any()
    assert torch.equal(checked, expected > 0)  # experts 1, 2 only got the non-finite rows
    expected[1:3] += 2
    assert torch.equal(acc, expected)

    state = ExpertState.zeros(8, 2, torch.device("cpu"))
    state.frozen.copy_(frozen)
    assert state.finite_rows(logits).tolist() == [True, False, True, False, True, True]


def test_route_no_tokens_changes_nothing() -> None:
    acc = torch.arange(4)
    checked = torch.tensor([True, False, False, False])
    weights, ids = fused_route(
        torch.zeros(0, 4), torch.zeros(4, dtype=torch.bool), 2, True, acc, checked
    )
    assert weights.shape == ids.shape == (0, 2)
    assert acc.tolist() == [0, 1, 2, 3] and checked.tolist() == [True, False, False, False]


def health_state(freeze_after: int) -> ExpertState:
    """Six experts, top_k 3, expert 1 frozen: room for two more frozen experts."""
    state = ExpertState.zeros(6, 3, torch.device("cpu"))
    state.set_freeze_after(freeze_after)
    state.frozen[1] = True
    state.streak.copy_(torch.tensor([2, 5, 2, 0, 2, 2]))
    state.num_anomalous.copy_(torch.tensor([4, 9, 0, 1, 2, 3]))
    state.checked.copy_(torch.tensor([True, False, True, True, True, True]))
    state.anomalous.copy_(torch.tensor([True, True, False, True, True, True]))
    return state


def run_health(state: ExpertState, impl: str) -> None:
    if impl == "torch":
        state.update_health()
    else:
        fused_health_update(
            state.checked,
            state.anomalous,
            state.num_anomalous,
            state.streak,
            state.frozen,
            state.top_k,
            state.freeze_after,
        )


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_health_update_streaks_and_room_rule(impl: str) -> None:
    state = health_state(freeze_after=3)
    run_health(state, impl)
    # Expert 1 was flagged without a check: not counted, its streak kept.
    assert state.num_anomalous.tolist() == [5, 9, 0, 2, 3, 4]
    assert state.streak.tolist() == [3, 5, 0, 1, 3, 3]
    # Experts 0, 4, 5 reach 3; room = 6 - 3 - 1 = 2: the lowest ids 0 and 4 are frozen.
    assert state.frozen.tolist() == [True, True, False, False, True, False]
    assert not state.checked.any() and not state.anomalous.any()
    run_health(state, impl)  # no checks: nothing changes, expert 5 still waits for room
    assert state.streak.tolist() == [3, 5, 0, 1, 3, 3]
    assert state.frozen.tolist() == [True, True, False, False, True, False]
    state.frozen[0] = False  # an operator unfreezes expert 0 (its streak stays at 3)
    run_health(state, impl)
    assert state.frozen.tolist() == [True, True, False, False, True, False]  # 0 refrozen first


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_health_update_disabled_by_zero_freeze_after(impl: str) -> None:
    state = health_state(freeze_after=0)
    run_health(state, impl)
    assert state.num_anomalous.tolist() == [5, 9, 0, 2, 3, 4]
    assert state.streak.tolist() == [3, 5, 0, 1, 3, 3]
    assert state.frozen.tolist() == [False, True, False, False, False, False]
    state.set_freeze_after(1)  # read from the tensor at the next update
    run_health(state, impl)
    assert state.frozen.tolist() == [True, True, False, True, False, False]


def test_health_update_matches_reference_on_random_states() -> None:
    gen = torch.Generator().manual_seed(9)
    for num_experts, top_k in ((16, 2), (100, 8)):
        ref = ExpertState.zeros(num_experts, top_k, torch.device("cpu"))
        ref.set_freeze_after(2)
        for _ in range(4):
            ref.checked.copy_(torch.rand(num_experts, generator=gen) < 0.6)
            ref.anomalous.copy_(torch.rand(num_experts, generator=gen) < 0.4)
            got = ExpertState(*(t.clone() for t in (ref.num_tokens, ref.num_anomalous,
                              ref.streak, ref.frozen, ref.checked, ref.anomalous,
                              ref.freeze_after)), top_k=top_k)  # fmt: skip
            ref.update_health()
            run_health(got, "triton")
            for name in ("num_anomalous", "streak", "frozen", "checked", "anomalous"):
                assert torch.equal(getattr(got, name), getattr(ref, name)), name
        assert ref.frozen.any() and int(ref.frozen.sum()) <= num_experts - top_k


@NAN_WARNINGS
@torch.no_grad()
def test_sparse_moe_block_fused_path_equals_torch_path() -> None:
    config = MoeConfig(num_experts=8, top_k=2, intermediate_size=8, renormalize=True)
    blocks = [SparseMoeBlock(16, config) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    for param in blocks[0].parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    blocks[1].load_state_dict(blocks[0].state_dict())
    fused, reference = blocks
    fused._use_fused_kernels = lambda hidden: True  # the CUDA path, interpreted on the CPU
    hidden = torch.randn(12, 16, generator=gen)
    bad = int(torch.bincount(select_experts(fused.gate(hidden), 2, True)[1].flatten()).argmax())
    for block in blocks:
        block.w2[bad] = NAN
    token_mask = torch.ones(12, dtype=torch.bool)
    token_mask[-2:] = False
    poisoned = hidden.clone()
    poisoned[3] = INF  # a real token already non-finite: routed, never checked
    # Only where the non-finite row goes differs: torch.topk picks arbitrary NaN entries, the
    # kernel the lowest-id unfrozen experts (0 and 1; nothing is frozen yet at step 1).
    masked = reference.expert_state().mask_logits(reference.gate(poisoned[3:4]))
    torch_ids = select_experts(masked, 2, True)[1].flatten()
    offset = torch.bincount(torch.tensor([0, 1]), minlength=8) - torch.bincount(
        torch_ids, minlength=8
    )
    rows = (torch.arange(12) != 3) & token_mask
    for step in range(4):
        x = poisoned if step == 1 else hidden
        out, ref_out = fused(x, token_mask), reference(x, token_mask)
        torch.testing.assert_close(out[rows], ref_out[rows], rtol=1e-5, atol=1e-6, equal_nan=True)
        assert torch.equal(out[~token_mask], torch.zeros(2, 16))  # padding: no expert ran
        assert torch.isfinite(out[3]).all() == torch.isfinite(ref_out[3]).all() == (step != 1)
        got, want = fused.expert_state(), reference.expert_state()
        for name in ("num_anomalous", "streak", "frozen", "checked", "anomalous"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (step, name)
        expected_tokens = want.num_tokens + (offset if step >= 1 else 0)
        assert torch.equal(got.num_tokens, expected_tokens), step
        assert int(got.num_anomalous[bad]) == min(step + 1, 3)
        assert bool(got.frozen[bad]) == (step >= 2)
    assert torch.isfinite(out).all()  # routed around the frozen expert
