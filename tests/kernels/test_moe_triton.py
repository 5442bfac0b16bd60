"""Fused MoE (`TritonMoe`) vs the PyTorch reference, the expert alignment and the configs.

Runs the kernels through Triton's CPU interpreter in float32 (or compiled, on a GPU machine).
Small launch blocks (16-32) make every path take several row and column tiles, K loops with
and without a ragged last step, padding rows and experts without tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton")

from sits.core.errors import InvalidParameterError  # noqa: E402
from sits.kernels.moe_align import (  # noqa: E402
    align_pairs_to_experts,
    max_padded_rows,
    pair_blocks,
)
from sits.kernels.moe_config import (  # noqa: E402
    CONFIG_DIR,
    GemmConfig,
    MoeConfigStore,
    MoeLaunchConfig,
    config_file_name,
    default_config,
    load_config_table,
    pick_config,
)
from sits.kernels.moe_ref import moe_forward, select_experts  # noqa: E402
from sits.kernels.moe_triton import TritonMoe, fused_moe  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402
from sits.layers.moe import MoeConfig, SparseMoeBlock  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail(
        "sits' Triton kernels were compiled (not interpreted) on a machine without a GPU: a "
        "module imported them before tests/kernels/conftest.py set TRITON_INTERPRET=1",
        pytrace=False,
    )

SMALL = MoeLaunchConfig(16, GemmConfig(16, 16, 1), GemmConfig(32, 16, 2))
WIDE = MoeLaunchConfig(32, GemmConfig(32, 32, 4), GemmConfig(16, 32, 1))


def make_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, seed: int):
    """(hidden, w13, w2, topk_weights, topk_ids) on DEVICE in float32, routing by softmax top-k."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, ids))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("method", ["single", "chunked", "torch"])
def test_align_hand_example(method: str) -> None:
    # pairs 0..5 = (t0: e2, e0), (t1: e2, e3), (t2: e0, e2); E = 5, block_m = 4
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    align = align_pairs_to_experts(ids, num_experts=5, block_m=4, method=method)
    assert max_padded_rows(6, 5, 4) == 6 + 5 * 3 == align.sorted_pair_ids.numel()
    pad = 6
    expected_rows = [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 9
    assert align.sorted_pair_ids.cpu().tolist() == expected_rows
    assert align.block_expert_ids.cpu().tolist() == [0, 2, 3, -1, -1, -1]
    assert align.num_padded_rows.cpu().tolist() == [12]
    assert align.sorted_pair_ids.dtype == align.block_expert_ids.dtype == torch.int32


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m"),
    [(1, 8, 2, 16), (5, 6, 6, 16), (33, 16, 4, 16), (7, 128, 8, 16), (64, 4, 2, 32), (3, 1, 1, 16),
     (150, 200, 3, 16), (200, 8, 2, 64)],  # 450 pairs over chunks of 64; 400 over 128
)  # fmt: skip
def test_align_methods_agree_and_are_consistent(num_tokens, num_experts, top_k, block_m) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    ).to(DEVICE)
    ours = align_pairs_to_experts(ids, num_experts, block_m, method="torch")
    for method in ("single", "chunked"):
        other = align_pairs_to_experts(ids, num_experts, block_m, method=method)
        for name in ("sorted_pair_ids", "block_expert_ids", "num_padded_rows"):
            assert torch.equal(getattr(ours, name), getattr(other, name)), (method, name)
    rows = ours.sorted_pair_ids.cpu()
    experts = ours.block_expert_ids.cpu()
    total = int(ours.num_padded_rows)
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    flat = ids.flatten().cpu()
    num_pairs = num_tokens * top_k
    assert sorted(rows[rows < num_pairs].tolist()) == list(range(num_pairs))  # each pair once
    assert (rows[total:] == num_pairs).all() and (experts[total // block_m :] == -1).all()
    for row, pair in enumerate(rows[:total].tolist()):
        if pair < num_pairs:
            assert flat[pair] == experts[row // block_m]


@pytest.mark.parametrize("method", ["single", "chunked", "torch"])
def test_align_gives_no_row_to_pairs_without_expert(method: str) -> None:
    # the hand example with token 1 as padding (ids -1): pairs 2 and 3 get no row
    ids = torch.tensor([[2, 0], [-1, -1], [0, 2]], device=DEVICE)
    align = align_pairs_to_experts(ids, num_experts=5, block_m=4, method=method)
    pad = 6
    expected_rows = [1, 4, pad, pad, 0, 5, pad, pad] + [pad] * 13
    assert align.sorted_pair_ids.cpu().tolist() == expected_rows
    assert align.block_expert_ids.cpu().tolist() == [0, 2, -1, -1, -1, -1]
    assert align.num_padded_rows.cpu().tolist() == [8]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(9, 16, 4), (60, 8, 2)])
def test_align_methods_agree_with_padding_tokens(num_tokens, num_experts, top_k) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    padding = torch.rand(num_tokens, generator=gen) < 0.4  # [T]
    ids[padding] = -1
    ids = ids.to(DEVICE)
    ours = align_pairs_to_experts(ids, num_experts, 16, method="torch")
    for method in ("single", "chunked"):
        other = align_pairs_to_experts(ids, num_experts, 16, method=method)
        for name in ("sorted_pair_ids", "block_expert_ids", "num_padded_rows"):
            assert torch.equal(getattr(ours, name), getattr(other, name)), (method, name)
    rows = ours.sorted_pair_ids.cpu()
    routed = torch.nonzero(ids.flatten().cpu() >= 0).flatten().tolist()
    assert sorted(rows[rows < num_tokens * top_k].tolist()) == routed  # routed pairs, once each
    counts = torch.bincount(ids[ids >= 0].cpu(), minlength=num_experts)
    assert int(ours.num_padded_rows) == int(((counts + 15) // 16 * 16).sum())


def test_align_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="power of two"):
        align_pairs_to_experts(torch.zeros(1, 1, dtype=torch.long), 2, 24)
    with pytest.raises(ValueError, match="method"):
        align_pairs_to_experts(torch.zeros(1, 1, dtype=torch.long), 2, 16, method="sort")


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "config"),
    [
        (1, 8, 2, 32, 48, SMALL),  # one token; most experts without tokens
        (5, 16, 2, 40, 24, SMALL),  # ragged K (40 % 16) and columns (24 % 16, 40 % 32)
        (6, 4, 4, 32, 32, WIDE),  # top_k == num_experts
        (17, 6, 3, 48, 40, WIDE),  # several row blocks per expert, GROUP_M 4
        (40, 8, 4, 32, 16, SMALL),  # 160 pairs: the chunked alignment
    ],
)
def test_fused_moe_matches_reference(num_tokens, num_experts, top_k, hidden, inter, config):
    x, w13, w2, weights, ids = make_inputs(num_tokens, num_experts, top_k, hidden, inter, seed=3)
    flags = torch.zeros(num_experts, dtype=torch.bool, device=DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, config, flags)
    expected = moe_forward(x, w13, w2, weights, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert relative_error(out, expected) < 1e-5
    assert not flags.any()


@pytest.mark.parametrize("config", [SMALL, WIDE])
def test_padding_tokens_without_experts_get_zero_rows(config) -> None:
    x, w13, w2, weights, ids = make_inputs(10, 8, 2, 32, 32, seed=8)
    padding = torch.tensor([False] * 7 + [True] * 3, device=DEVICE)  # decode 7 padded to 10
    ids[padding], weights[padding] = -1, 0.0
    flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, config, flags)
    expected = moe_forward(x, w13, w2, weights, ids)
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    assert torch.equal(expected[padding], torch.zeros_like(expected[padding]))
    real = moe_forward(x[:7], w13, w2, weights[:7], ids[:7])  # the real tokens alone
    assert relative_error(out[:7], real) < 1e-5
    assert not flags.any()


def test_one_token_step_uses_a_block_per_pair() -> None:
    x, w13, w2, weights, ids = make_inputs(1, 8, 3, 32, 32, seed=9)
    assert pair_blocks(ids, 16).one_pair_per_block and pair_blocks(ids, 16).max_num_blocks == 3
    flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, SMALL, flags)
    assert relative_error(out, moe_forward(x, w13, w2, weights, ids)) < 1e-5
    padding = torch.full_like(ids, -1)  # a one-token step of padding (a warm-up)
    empty = fused_moe(x, w13, w2, torch.zeros_like(weights), padding, SMALL, flags)
    assert torch.equal(empty, torch.zeros_like(empty)) and not flags.any()
    w2[int(ids[0, 1]), 0, 0] = float("nan")
    fused_moe(x, w13, w2, weights, ids, SMALL, flags)
    assert flags.cpu().tolist() == [e == int(ids[0, 1]) for e in range(8)]


def test_float16_matches_reference() -> None:
    x, w13, w2, weights, ids = make_inputs(9, 8, 2, 32, 32, seed=4)
    half = [t.half() for t in (x, w13, w2)]
    out = fused_moe(*half, weights, ids, SMALL)
    assert out.dtype == torch.float16
    assert relative_error(out, moe_forward(*half, weights, ids).float()) < 5e-3


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_flag_only_for_finite_input_rows() -> None:
    x, w13, w2, weights, ids = make_inputs(12, 8, 2, 32, 32, seed=5)
    bad = int(ids[0, 1])  # routed at least once
    w2[bad, 3, 5] = float("nan")
    x[1] = float("inf")  # a poisoned input row: its experts' outputs are not their fault
    innocent = set(ids[1].tolist())
    assert bad not in innocent
    flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    ref_flags = torch.zeros(8, dtype=torch.bool, device=DEVICE)
    out = TritonMoe(SMALL).experts(x, w13, w2, weights, ids, flags)
    expected = moe_forward(x, w13, w2, weights, ids, ref_flags)
    assert torch.equal(flags, ref_flags)
    assert flags.cpu().tolist() == [e == bad for e in range(8)]
    assert torch.equal(torch.isfinite(out), torch.isfinite(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)

    already = torch.ones(8, dtype=torch.bool, device=DEVICE)  # flags are only ever set
    TritonMoe(SMALL).experts(x, w13, w2, weights, ids, already)
    assert already.all()


def test_backend_selects_like_reference_and_handles_empty_batch() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 8, generator=gen).to(DEVICE)
    backend = TritonMoe(SMALL)
    for got, want in zip(backend.select_experts(logits, 2, True), select_experts(logits, 2, True)):
        assert torch.equal(got, want)
    x, w13, w2, weights, ids = make_inputs(0, 4, 2, 32, 16, seed=7)
    assert backend.experts(x, w13, w2, weights, ids).shape == (0, 32)


def test_config_json_round_trip_and_bucket_choice(tmp_path, monkeypatch) -> None:
    flat = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4}
    nested = WIDE.to_json()
    name = config_file_name(4, 16, torch.float32, "cpu")
    assert name == "moe_E4_N16_fp32_cpu.json"
    (tmp_path / name).write_text(json.dumps({"1": flat, "64": nested}))
    table = load_config_table(tmp_path / name)
    assert table[1] == MoeLaunchConfig(16, GemmConfig(32, 64, 1, 4, 3), GemmConfig(32, 64, 1, 4, 3))
    assert table[64] == WIDE
    assert [pick_config(table, t) for t in (1, 2, 64, 65, 9000)] == [table[1]] + [WIDE] * 4
    store = MoeConfigStore(tmp_path)
    cpu = torch.device("cpu")
    assert store.select(30, 2, 4, 16, torch.float32, cpu) == WIDE
    assert store.select(30, 2, 4, 32, torch.float32, cpu) == default_config(30, 2, 4)
    monkeypatch.setenv("SITS_MOE_CONFIG_DIR", str(tmp_path))  # read when a store is made
    assert MoeConfigStore().config_dir == tmp_path
    assert MoeConfigStore().select(30, 2, 4, 16, torch.float32, cpu) == WIDE
    monkeypatch.delenv("SITS_MOE_CONFIG_DIR")
    assert MoeConfigStore().config_dir == CONFIG_DIR
    (tmp_path / "bad.json").write_text('{"1": {"BLOCK_N": 16}}')
    with pytest.raises(InvalidParameterError):
        load_config_table(tmp_path / "bad.json")
    with pytest.raises(InvalidParameterError):
        GemmConfig(block_n=24, block_k=32)


def test_default_config_by_rows_per_expert() -> None:
    assert default_config(1, 8, 128).block_m == 16
    assert default_config(512, 8, 128).block_m == 64
    assert default_config(8192, 8, 128).block_m == 128


def test_shipped_config_files_parse_and_cover_the_tuned_token_counts() -> None:
    files = sorted(CONFIG_DIR.glob("moe_E*_N*_*.json"))
    for path in files:
        table = load_config_table(path)
        assert sorted(table) == [2**i for i in range(14)], path.name


def test_spare_slots_keep_the_tuned_config_of_the_model_expert_count(tmp_path) -> None:
    """w13/w2 of a layer with 2 spare slots hold E + 2 experts; the tuned file is per E."""
    (tmp_path / config_file_name(4, 16, torch.float32, "cpu")).write_text(
        json.dumps({"64": WIDE.to_json()})
    )
    backend = TritonMoe(config_dir=tmp_path)
    block = SparseMoeBlock(8, MoeConfig(4, 2, 16, True), moe_backend=backend)
    hidden = torch.zeros(30, 8)
    w2_with_spares = torch.zeros(6, 8, 16)
    assert backend.launch_config(hidden, w2_with_spares, 2) == default_config(30, 2, 6)
    block.add_spare_slots(2)
    assert block.w2.shape[0] == 6 and backend.tuned_num_experts == 4
    assert backend.launch_config(hidden, block.w2, 2) == WIDE
