"""The Triton RMSNorm and q/k-norm + RoPE kernels vs their PyTorch references (`RMSNorm.
forward_reference`, `RotaryEmbedding.forward_reference`), in the CPU interpreter (or compiled
on a GPU). float32 and float16 on small shapes; float16 results must match bit for bit (the
kernels round where torch rounds).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sits.kernels.norm_triton import MAX_HIDDEN, triton_rms_norm  # noqa: E402
from sits.kernels.rotary_triton import heads_per_program, triton_qk_norm_rope  # noqa: E402
from sits.kernels.triton_utils import kernels_interpreted  # noqa: E402
from sits.layers.norm import MAX_TRITON_HIDDEN, RMSNorm  # noqa: E402
from sits.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

DEVICE = "cpu" if kernels_interpreted() else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.fail(
        "sits' Triton kernels were compiled (not interpreted) on a machine without a GPU: a "
        "module imported them before tests/kernels/conftest.py set TRITON_INTERPRET=1",
        pytrace=False,
    )

YARN = RopeConfig(
    head_dim=24,
    rope_type="yarn",
    theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    max_position_embeddings=256,
)  # attention_scaling != 1: it must be folded into the cache
LLAMA3 = RopeConfig(
    head_dim=32,
    rope_type="llama3",
    theta=500000.0,
    factor=8.0,
    original_max_position_embeddings=64,
    max_position_embeddings=128,
)


def make_norm(hidden_size: int, dtype: torch.dtype, seed: int, eps: float = 1e-5) -> RMSNorm:
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(hidden_size, eps)
    norm.weight.data = torch.randn(hidden_size, generator=gen)
    return norm.to(DEVICE, dtype).requires_grad_(False)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize(
    ("dtype", "num_tokens", "hidden_size", "with_residual"),
    [
        (torch.float32, 5, 64, True),
        (torch.float32, 3, 48, False),  # hidden not a power of two: masked lanes
        (torch.float16, 4, 96, True),
        (torch.float16, 2, 40, False),
    ],
)
def test_rms_norm_matches_reference(
    dtype: torch.dtype, num_tokens: int, hidden_size: int, with_residual: bool
) -> None:
    norm = make_norm(hidden_size, dtype, seed=hidden_size)
    x = randn(num_tokens, hidden_size + 16, dtype=dtype, seed=1)[:, 8 : 8 + hidden_size]
    assert not x.is_contiguous()  # strided rows, as a view of a wider tensor
    residual = randn(num_tokens, hidden_size, dtype=dtype, seed=2) if with_residual else None
    x_before = x.clone()
    out, residual_out = triton_rms_norm(x, norm.weight, norm.eps, residual)
    expected, expected_residual = norm.forward_reference(x, residual)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden_size)
    assert torch.equal(residual_out, expected_residual)  # one rounding of the sum, both
    if dtype == torch.float16:
        assert torch.equal(out, expected)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(x, x_before)
    if residual is None:
        assert residual_out is x  # the reference returns x itself


def test_rms_norm_rejects_what_it_cannot_compute() -> None:
    norm = make_norm(16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="x must be"):
        triton_rms_norm(randn(2, 3, 16, dtype=torch.float32, seed=0), norm.weight, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        triton_rms_norm(randn(2, 16, dtype=torch.float16, seed=0), norm.weight, 1e-6)
    assert MAX_TRITON_HIDDEN == MAX_HIDDEN  # the layer's dispatch bound is the kernel's


def fused_qk(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(qkv, q, k): q [T, H, D] and k [T, K, D] are strided views of qkv [T, (H + 2K) * D]."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=num_heads)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, _ = qkv.split(sizes, dim=-1)
    return (
        qkv,
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
    )


def run_rope(
    rope: RopeConfig,
    dtype: torch.dtype,
    positions: list[int],
    num_heads: int,
    num_kv_heads: int,
    with_norm: bool,
    block_heads: int | None = None,
) -> None:
    """Check triton_qk_norm_rope (out of place, then in place) against the reference."""
    num_tokens, head_dim = len(positions), rope.head_dim
    emb = RotaryEmbedding(rope)
    qkv, q, k = fused_qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    norms = (make_norm(head_dim, dtype, 3, 1e-6), make_norm(head_dim, dtype, 4, 1e-5))
    qk_norm = norms if with_norm else None
    pos = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    expected_q, expected_k = emb.forward_reference(pos, q, k, qk_norm)
    cos, sin = emb.cos_sin_cache(q.device, dtype)
    weights = (norms[0].weight, norms[1].weight) if with_norm else (None, None)
    eps = (norms[0].eps, norms[1].eps)
    qkv_before = qkv.clone()
    out_q, out_k = triton_qk_norm_rope(q, k, pos, cos, sin, *weights, *eps, block_heads=block_heads)
    assert torch.equal(qkv, qkv_before)  # out of place: inputs untouched
    assert out_q.shape == q.shape and out_k.shape == k.shape and out_q.dtype == dtype
    if dtype == torch.float16:
        assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    else:
        torch.testing.assert_close(out_q, expected_q, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(out_k, expected_k, rtol=1e-5, atol=2e-6)
    in_q, in_k = triton_qk_norm_rope(
        q, k, pos, cos, sin, *weights, *eps, in_place=True, block_heads=block_heads
    )
    assert in_q is q and in_k is k
    assert torch.equal(q, out_q) and torch.equal(k, out_k)
    qk_width = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, qk_width:], qkv_before[:, qk_width:])  # v untouched


@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_float32_yarn(with_norm: bool) -> None:
    # Hq != Hk, head_dim 24 (half 12: masked lanes), positions up to the cache end.
    run_rope(YARN, torch.float32, [0, 255, 3, 100, 254], 3, 1, with_norm)


@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_float16_is_bit_exact(with_norm: bool) -> None:
    run_rope(LLAMA3, torch.float16, [5, 127, 0, 64], 4, 2, with_norm)


def test_qk_norm_rope_several_heads_per_program() -> None:
    # 4 heads per program: q heads 0-3 and 4 (masked tail) in two programs, k in one.
    run_rope(LLAMA3, torch.float32, [1, 127, 30], 5, 2, True, block_heads=4)


def test_heads_per_program_grows_with_the_step() -> None:
    assert heads_per_program(1, 32) == 1  # decode: one head per program, 36 programs
    assert heads_per_program(64, 32) == 2
    assert heads_per_program(4096, 32) == 8
    assert heads_per_program(4096, 2) == 2  # never more than the heads


def test_cos_sin_cache_holds_the_reference_values_once() -> None:
    emb = RotaryEmbedding(YARN)
    cos, sin = emb.cos_sin_cache(torch.device("cpu"), torch.float32)
    assert cos.shape == sin.shape == (256, 12) and cos.is_contiguous()
    positions = torch.tensor([0, 1, 17, 255])
    ref_cos, ref_sin = emb.cos_sin(positions, torch.float32)  # [4, 24], halves repeated
    torch.testing.assert_close(cos[positions], ref_cos[:, :12], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[positions], ref_sin[:, 12:], rtol=0, atol=1e-6)
    assert emb.attention_scaling > 1.0  # folded in: the cache is not plain cos
    assert float(cos[0, 0]) == pytest.approx(emb.attention_scaling)
    assert emb.cos_sin_cache(torch.device("cpu"), torch.float32)[0] is cos  # built once
    no_max = RotaryEmbedding(RopeConfig(head_dim=8))
    with pytest.raises(RuntimeError, match="max_position_embeddings"):
        no_max.cos_sin_cache(torch.device("cpu"), torch.float32)


def test_max_position_embeddings_is_read_but_not_compared() -> None:
    rope = RopeConfig.from_dict({"rope_type": "default"}, head_dim=8, max_position_embeddings=99)
    assert rope.max_position_embeddings == 99
    assert rope == RopeConfig(head_dim=8)


def test_qk_norm_rope_rejects_mismatched_caches() -> None:
    emb = RotaryEmbedding(LLAMA3)
    _, q, k = fused_qk(2, 2, 1, 32, torch.float32)
    cos, sin = emb.cos_sin_cache(q.device, torch.float32)
    pos = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="cos/sin caches"):
        triton_qk_norm_rope(q, k, pos, cos.half(), sin.half())
    with pytest.raises(ValueError, match="both"):
        triton_qk_norm_rope(q, k, pos, cos, sin, q_norm_weight=torch.ones(32, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU tests cover the layers on CUDA")
def test_tiny_qwen3_through_the_kernels_matches_the_torch_path(
    tiny_model_factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layers' Triton wiring (fused residual norm, q/k norm + RoPE in place on the QKV
    views, strided q into attention), forced on the CPU through the interpreter."""
    from sits.models.loader import load_model
    from tests.models.paged import PagedRunner

    model = load_model(str(tiny_model_factory("qwen3")), torch.float32, "cpu")
    tokens = torch.randint(3, 512, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    pieces = [tokens[:7]] + [[token] for token in tokens[7:]]  # prefill, then 3 decode steps

    def run() -> torch.Tensor:
        runner = PagedRunner(model, block_size=4)
        return torch.cat([runner.step([("a", piece)])[0] for piece in pieces])

    expected = run()
    calls = {"norm": 0, "rope": 0}

    def count(kind: str):
        def applies(*args: object) -> bool:
            calls[kind] += 1
            return True

        return applies

    monkeypatch.setattr(RMSNorm, "_triton_applies", count("norm"))
    monkeypatch.setattr(RotaryEmbedding, "_triton_applies", count("rope"))
    actual = run()
    num_layers = model.num_layers
    assert calls == {"norm": 4 * (2 * num_layers + 1), "rope": 4 * num_layers}
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
