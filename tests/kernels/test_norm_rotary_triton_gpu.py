"""The Triton RMSNorm and q/k-norm + RoPE kernels on an NVIDIA GPU in bfloat16 at real shapes.

Shapes of Qwen3-30B-A3B (hidden 2048, 32 query heads, 4 kv heads, head_dim 128, q/k norm) and
Llama-3.1-8B (hidden 4096, 8 kv heads, llama3 rope), 1 to 4096 tokens, against the PyTorch
references (`RMSNorm.forward_reference`, `RotaryEmbedding.forward_reference`): the kernels round
where torch rounds, so only the float32 sums of squares may differ (rarely, by 1 bf16 ulp); RoPE
without the norm must match bit for bit. Also: the layers dispatch to the kernels on CUDA, and
both kernels are captured in a CUDA graph and replayed over new inputs.

Run on the GPU machine: `pytest tests/kernels -m gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU", allow_module_level=True)
pytest.importorskip("triton")

from sits.kernels.norm_triton import triton_rms_norm  # noqa: E402
from sits.layers.norm import RMSNorm  # noqa: E402
from sits.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

DTYPE = torch.bfloat16
RTOL, ATOL = 1.6e-2, 1e-2  # bfloat16: 2 ulp
MAX_MISMATCH_FRACTION = 1e-3  # elements allowed to differ (by rounding of float32 sums)
QWEN3_ROPE = RopeConfig(head_dim=128, theta=1000000.0, max_position_embeddings=40960)
LLAMA3_ROPE = RopeConfig(
    head_dim=128,
    rope_type="llama3",
    theta=500000.0,
    factor=8.0,
    original_max_position_embeddings=8192,
    max_position_embeddings=131072,
)
YARN_ROPE = RopeConfig(
    head_dim=128,
    rope_type="yarn",
    theta=1000000.0,
    factor=4.0,
    original_max_position_embeddings=32768,
    max_position_embeddings=131072,
)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(DTYPE)


def make_norm(size: int, seed: int, eps: float = 1e-6) -> RMSNorm:
    norm = RMSNorm(size, eps)
    norm.weight.data = 1.0 + 0.1 * torch.randn(size, generator=torch.Generator().manual_seed(seed))
    return norm.to("cuda", DTYPE).requires_grad_(False)


def assert_bf16_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 tolerance, and equal except for a small fraction of elements."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)
    mismatches = int((actual != expected).sum())
    assert mismatches <= MAX_MISMATCH_FRACTION * actual.numel() + 2, mismatches


@pytest.mark.parametrize("hidden_size", [2048, 4096])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 4096])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(hidden_size: int, num_tokens: int, with_residual: bool) -> None:
    norm = make_norm(hidden_size, seed=hidden_size)
    x = randn(num_tokens, hidden_size, seed=num_tokens, scale=4.0)
    residual = randn(num_tokens, hidden_size, seed=num_tokens + 1) if with_residual else None
    out, residual_out = triton_rms_norm(x, norm.weight, norm.eps, residual)
    expected, expected_residual = norm.forward_reference(x, residual)
    assert torch.equal(residual_out, expected_residual)
    assert_bf16_close(out, expected)


def test_rms_norm_wide_rows_and_strided_input() -> None:
    norm = make_norm(8192, seed=1)
    wide = randn(33, 8192 + 256, seed=2)
    x = wide[:, 128 : 128 + 8192]  # [33, 8192], row stride 8448
    residual = randn(33, 8192, seed=3)
    out, residual_out = triton_rms_norm(x, norm.weight, norm.eps, residual)
    expected, expected_residual = norm.forward_reference(x, residual)
    assert torch.equal(residual_out, expected_residual)
    assert_bf16_close(out, expected)


def qkv_views(num_tokens: int, num_heads: int, num_kv_heads: int, seed: int) -> tuple:
    """(qkv, q, k): q [T, H, 128], k [T, K, 128] strided views of one fused QKV output."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * 128, seed=seed, scale=3.0)
    q, k, _ = qkv.split([num_heads * 128, num_kv_heads * 128, num_kv_heads * 128], dim=-1)
    return qkv, q.view(num_tokens, num_heads, 128), k.view(num_tokens, num_kv_heads, 128)


def positions_of(num_tokens: int, max_positions: int, seed: int) -> torch.Tensor:
    """Random positions including 0 and the cache's last position."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen, device="cuda")
    positions[0] = max_positions - 1
    if num_tokens > 1:
        positions[1] = 0
    return positions


@pytest.mark.parametrize(
    ("rope", "num_kv_heads", "with_norm"),
    [(QWEN3_ROPE, 4, True), (LLAMA3_ROPE, 8, False), (YARN_ROPE, 4, True)],
    ids=["qwen3", "llama3", "yarn"],
)
@pytest.mark.parametrize("num_tokens", [1, 3, 64, 2048, 4096])
def test_qk_norm_rope_matches_reference(
    rope: RopeConfig, num_kv_heads: int, with_norm: bool, num_tokens: int
) -> None:
    emb = RotaryEmbedding(rope)
    norms = (make_norm(128, seed=5), make_norm(128, seed=6)) if with_norm else None
    _, q, k = qkv_views(num_tokens, 32, num_kv_heads, seed=num_tokens)
    positions = positions_of(num_tokens, rope.max_position_embeddings, seed=num_tokens)
    expected_q, expected_k = emb.forward_reference(positions, q, k, norms)
    out_q, out_k = emb(positions, q, k, qk_norm=norms)  # dispatches to the Triton kernel
    assert out_q.data_ptr() != q.data_ptr()  # not in place unless asked
    if with_norm:
        assert_bf16_close(out_q, expected_q)
        assert_bf16_close(out_k, expected_k)
    else:  # same cos/sin values, same roundings: bit for bit
        assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)


def test_layers_dispatch_to_triton_and_rotate_in_place() -> None:
    emb = RotaryEmbedding(QWEN3_ROPE)
    norms = (make_norm(128, seed=7), make_norm(128, seed=8))
    qkv, q, k = qkv_views(5, 32, 4, seed=9)
    before = qkv.clone()
    positions = positions_of(5, 40960, seed=9)
    expected_q, expected_k = emb.forward_reference(positions, q, k, norms)
    out_q, out_k = emb(positions, q, k, qk_norm=norms, in_place=True)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_bf16_close(out_q, expected_q)
    assert_bf16_close(out_k, expected_k)
    assert torch.equal(qkv[:, 36 * 128 :], before[:, 36 * 128 :])  # v untouched
    norm = make_norm(2048, seed=10)
    x, residual = randn(5, 2048, seed=11), randn(5, 2048, seed=12)
    out, residual_out = norm(x, residual)
    expected, expected_residual = norm.forward_reference(x, residual)
    assert torch.equal(residual_out, expected_residual)
    assert_bf16_close(out, expected)


def test_kernels_in_a_cuda_graph_replay_new_inputs() -> None:
    emb = RotaryEmbedding(QWEN3_ROPE)
    q_norm, k_norm = make_norm(128, seed=13), make_norm(128, seed=14)
    norm = make_norm(2048, seed=15)
    num_tokens = 8
    static_x, static_residual = randn(num_tokens, 2048, seed=16), randn(num_tokens, 2048, seed=17)
    static_qkv, static_q, static_k = qkv_views(num_tokens, 32, 4, seed=18)
    static_positions = positions_of(num_tokens, 40960, seed=18)

    def step() -> tuple[torch.Tensor, ...]:
        out, residual_out = norm(static_x, static_residual)
        q, k = emb(static_positions, static_q, static_k, qk_norm=(q_norm, k_norm), in_place=True)
        return out, residual_out, q, k

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels and builds the cos/sin cache
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    for seed in (20, 30):
        x, residual = randn(num_tokens, 2048, seed=seed), randn(num_tokens, 2048, seed=seed + 1)
        qkv, q, k = qkv_views(num_tokens, 32, 4, seed=seed + 2)
        positions = positions_of(num_tokens, 40960, seed=seed + 3)
        static_x.copy_(x)
        static_residual.copy_(residual)
        static_qkv.copy_(qkv)
        static_positions.copy_(positions)
        graph.replay()
        torch.cuda.synchronize()
        expected_out, expected_residual = norm.forward_reference(x, residual)
        expected_q, expected_k = emb.forward_reference(positions, q, k, (q_norm, k_norm))
        assert torch.equal(outputs[1], expected_residual)
        assert_bf16_close(outputs[0], expected_out)
        assert_bf16_close(outputs[2], expected_q)
        assert_bf16_close(outputs[3], expected_k)


def test_cos_sin_cache_cannot_be_built_during_capture() -> None:
    emb = RotaryEmbedding(QWEN3_ROPE)  # no forward yet: no cache
    _, q, k = qkv_views(2, 32, 4, seed=40)
    positions = positions_of(2, 40960, seed=40)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capture"), torch.cuda.graph(graph):
        emb(positions, q, k)
