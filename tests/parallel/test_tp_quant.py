"""Quantized weights under tensor and expert parallelism (issues 25 and 27): two gloo ranks,
each loading its shard of a quantized model, give the logits and greedy tokens of one rank
with the same quantization: online FP8 and INT4 (`quantization="fp8" | "int4"` of a float32
checkpoint), an FP8 block-scaled checkpoint, GPTQ and AWQ checkpoints (made here in their
layouts by the quant tests' builders), and with expert parallelism FP8 and GPTQ experts; each
rank's storage is TP=1's sliced (per-row scales of row-parallel layers whole); a slice that
cuts through scale blocks or groups is refused when the model is built, with the numbers.

Tolerance: logits within 1e-5 absolute (float32 on the CPU; both sides dequantize the same
float8 / 4-bit values with the same scales, so only the order of the sums differs); greedy
tokens equal.

One spawn of two processes serves every case (`test_tp_model._spawn_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from sits import LLM, SamplingParams
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError, UnsupportedModelError
from sits.kernels.fp8_ref import FP8_DTYPE
from sits.layers.quant.fp8_linear import Fp8FusedLinear
from sits.layers.quant.fp8_moe import Fp8SparseMoeBlock
from sits.layers.quant.int4_moe import Int4SparseMoeBlock
from sits.models.loader import build_meta_model, load_model
from sits.parallel import TensorParallel
from sits.runner.tp_executor import check_tensor_parallel_fit
from sits.testing.tiny import cached_tiny_checkpoint, tiny_config
from tests.models import test_quantized_fp8 as fp8_formats
from tests.models import test_quantized_int4 as int4_formats
from tests.models.quant_checkpoints import write_checkpoint
from tests.parallel.test_tp_model import ATOL, TP_SIZE, _generate, _spawn_ranks

BLOCK = (16, 16)  # every rank's rows and columns fall on whole blocks of the tiny models
FP8_BLOCK_CONFIG = {**fp8_formats.FORMATS["fp8_block"], "weight_block_size": list(BLOCK)}
# hidden 48: online INT4 fits group 16 on one rank and on two (the slices are 32 and 16 wide)
INT4_ONLINE = {"hidden_size": 48}

# (case id, arch, config overrides, checkpoint format or None, quantization, expert parallel)
CASES = [
    ("fp8-online-moe", "qwen3_moe", {}, None, "fp8", False),
    # 1 KV head replicated on both ranks; o_proj / down_proj biases added once after the sum.
    ("fp8-online-llama-kv1-biases", "llama",
     {"num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True}, None, "fp8", False),
    ("int4-online-moe", "qwen3_moe", INT4_ONLINE, None, "int4", False),
    ("int4-online-qwen3", "qwen3", INT4_ONLINE, None, "int4", False),
    ("fp8-block-moe", "qwen3_moe", {}, "fp8_block", None, False),
    ("gptq-moe", "qwen3_moe", {}, "gptq", None, False),
    ("awq-llama", "llama", {}, "awq", None, False),
    ("ep-fp8-online-moe", "qwen3_moe", {}, None, "fp8", True),
    ("ep-fp8-block-mixtral", "mixtral", {}, "fp8_block", None, True),
    ("ep-gptq-moe", "qwen3_moe", {}, "gptq", None, True),
]  # fmt: skip
INSPECTED = ("fp8-online-moe", "fp8-block-moe", "gptq-moe")


def _quantized_checkpoint(src: Path, dst: Path, fmt: str) -> Path:
    """`src` with every quantizable weight in format `fmt`'s layout (the quant tests'
    builders: FP8 with BLOCK-sized scale blocks, INT4 with their group 16)."""
    quantize: Callable[[str, torch.Tensor], tuple[dict, torch.Tensor]]
    if fmt == "fp8_block":
        is_quantized, config = fp8_formats._is_quantized, FP8_BLOCK_CONFIG
        quantize = lambda name, weight: fp8_formats._quantize(fmt, name, weight, BLOCK)  # noqa: E731
    else:
        is_quantized, config = int4_formats._is_quantized, int4_formats.FORMATS[fmt]
        quantize = lambda name, weight: int4_formats._quantize(fmt, name, weight)  # noqa: E731
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        weights.update(quantize(name, tensor)[0] if is_quantized(name) else {name: tensor})
    return write_checkpoint(src, dst, weights, config)


def _inspected(model) -> dict[str, torch.Tensor]:
    """Layer 0's quantized storage: o_proj's and the experts' weights and scales."""
    o_proj, mlp = model.model.layers[0].self_attn.o_proj, model.model.layers[0].mlp
    found = {f"o_proj.{name}": p.clone() for name, p in o_proj.named_parameters()}
    found |= {f"mlp.{name}": p.clone() for name, p in mlp.named_parameters() if "w2" in name}
    return found


def _rank_main(rank: int, port: int, cases: list[tuple], out_dir: str) -> None:
    """One rank: load each case's shard, generate, save {case: (logits, tokens)} and the
    inspected cases' layer-0 storage."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=TP_SIZE, init_method=f"tcp://127.0.0.1:{port}"
    )
    try:
        results = {}
        for case_id, model_dir, quantization, expert_parallel in cases:
            tp = TensorParallel(rank=rank, size=TP_SIZE, expert_parallel=expert_parallel)
            model = load_model(model_dir, torch.float32, "cpu", quantization=quantization, tp=tp)
            results[case_id] = _generate(model)
            if case_id in INSPECTED:
                results[f"{case_id}/storage"] = _inspected(model)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("tp_quant")
    dirs = {}
    for case_id, arch, overrides, fmt, _, _ in CASES:
        src = cached_tiny_checkpoint(arch, base, with_tokenizer=False, **overrides)
        dirs[case_id] = str(src if fmt is None else _quantized_checkpoint(src, base / case_id, fmt))
    return dirs


@pytest.fixture(scope="module")
def rank_results(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("tp_quant_ranks")
    cases = [(case[0], checkpoints[case[0]], case[4], case[5]) for case in CASES]
    _spawn_ranks(cases, out_dir, _rank_main)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(TP_SIZE)]


def _one_rank(checkpoints: dict[str, str], case_id: str):
    quantization = next(case[4] for case in CASES if case[0] == case_id)
    return load_model(checkpoints[case_id], torch.float32, "cpu", quantization=quantization)


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_two_quantized_ranks_equal_one(checkpoints, rank_results, case_id: str) -> None:
    """Every rank's prefill and decode logits equal one rank's with the same quantization
    within 1e-5; greedy tokens equal."""
    whole = _one_rank(checkpoints, case_id)
    assert whole.model.layers[0].self_attn.o_proj.weight.dtype in (FP8_DTYPE, torch.int32)
    want_steps, want_tokens = _generate(whole)
    for rank, results in enumerate(rank_results):
        steps, tokens = results[case_id]
        assert tokens == want_tokens, f"rank {rank}"
        for step, (got, want) in enumerate(zip(steps, want_steps, strict=True)):
            torch.testing.assert_close(
                got, want, atol=ATOL, rtol=0, msg=lambda m, r=rank, s=step: f"rank {r}, {s}: {m}"
            )


def test_online_fp8_slices_what_one_rank_quantizes(checkpoints, rank_results) -> None:
    """Rank r's o_proj holds columns [32r, 32r + 32) of one rank's FP8 values and the whole
    rows' scales; its experts' w2 the same columns, with the full rows' scales too."""
    whole = _inspected(_one_rank(checkpoints, "fp8-online-moe"))
    for rank, results in enumerate(rank_results):
        got = results["fp8-online-moe/storage"]
        assert got.keys() == whole.keys()
        for name in ("o_proj.weight", "mlp.w2"):
            width = whole[name].shape[-1] // TP_SIZE
            want = whole[name][..., rank * width : (rank + 1) * width]
            assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name
        for name in ("o_proj.weight_scale", "mlp.w2_scale"):
            assert torch.equal(got[name], whole[name]), name  # the full rows' scales


def test_block_and_group_scales_are_cut_by_whole_blocks(checkpoints, rank_results) -> None:
    """FP8 block scales of rank r's o_proj are one rank's block columns [2r, 2r + 2) (32 of 64
    columns in 16-wide blocks); GPTQ experts' w2 group scales and zeros are its groups
    [r, r + 1) (16 of 32 columns in groups of 16)."""
    fp8_whole = _inspected(_one_rank(checkpoints, "fp8-block-moe"))
    int4_whole = _inspected(_one_rank(checkpoints, "gptq-moe"))
    for rank, results in enumerate(rank_results):
        fp8, int4 = results["fp8-block-moe/storage"], results["gptq-moe/storage"]
        assert fp8["o_proj.weight_scale"].shape == (4, 2)  # [ceil(64 / 16), 32 / 16]
        blocks = fp8_whole["o_proj.weight_scale"][:, 2 * rank : 2 * rank + 2]
        assert torch.equal(fp8["o_proj.weight_scale"], blocks)
        assert torch.equal(fp8["mlp.w2_scale"], fp8_whole["mlp.w2_scale"][..., rank : rank + 1])
        for name in ("mlp.w2_scale", "mlp.w2_zero"):
            assert int4[name].shape[-1] == 1
            assert torch.equal(int4[name], int4_whole[name][..., rank : rank + 1]), name
        assert torch.equal(int4["mlp.w2_g_idx"], torch.zeros_like(int4["mlp.w2_g_idx"]))


def test_the_engine_serves_online_fp8_on_two_ranks(checkpoints) -> None:
    """`LLM(..., tensor_parallel_size=2, quantization="fp8")` (a worker process, the
    executor's shape check) gives one rank's greedy tokens."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42]}, {"prompt_token_ids": [9, 511, 128]}]
    tokens = []
    for size in (1, TP_SIZE):
        llm = LLM(
            checkpoints["fp8-online-moe"], dtype="float32", skip_tokenizer_init=True,
            max_model_len=64, kv_cache_memory_bytes=2**21, quantization="fp8",
            tensor_parallel_size=size, tensor_parallel_timeout_s=60.0,
        )  # fmt: skip
        try:
            tokens.append([out.outputs[0].token_ids for out in llm.generate(prompts, params)])
            if size == TP_SIZE:
                assert isinstance(
                    llm.engine_core.runner.model.model.layers[0].self_attn.o_proj, Fp8FusedLinear
                )
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1] and len(tokens[0][0]) == 6


def _config_dir(tmp_path: Path, arch: str, quantization_config: dict, **overrides) -> str:
    """A config.json with `quantization_config` (enough for the meta model)."""
    config = tiny_config(arch, **overrides)
    config.quantization_config = quantization_config
    config.save_pretrained(tmp_path)
    return str(tmp_path)


REFUSED = [
    pytest.param(
        "llama", fp8_formats.FORMATS["fp8_block"], False,  # blocks (16, 24)
        r"model\.layers\.0\.self_attn\.o_proj: tensor parallelism gives a rank input columns "
        r"\[0, 32\) of 64, which do not fall on the boundaries of 24-wide FP8 scale blocks",
        id="fp8-o_proj-columns",
    ),
    pytest.param(
        "qwen3_moe", {**FP8_BLOCK_CONFIG, "weight_block_size": [16, 32]}, False,
        r"model\.layers\.0\.mlp: tensor parallelism gives a rank input columns \[0, 16\) of 32, "
        r"which do not fall on the boundaries of 32-wide FP8 scale blocks \(.*, experts\)",
        id="fp8-experts-w2-columns",
    ),
    pytest.param(
        "qwen3_moe", {**FP8_BLOCK_CONFIG, "weight_block_size": [32, 16]}, True,
        r"self_attn\.qkv_proj: tensor parallelism gives a rank output rows of part 1 \[0, 16\) "
        r"of 32, which do not fall on the boundaries of 32-wide FP8 scale blocks",
        id="fp8-kv-rows-expert-parallel",
    ),
    pytest.param(
        "llama", {**int4_formats.FORMATS["gptq"], "group_size": 64}, False,
        r"model\.layers\.0\.self_attn\.o_proj: tensor parallelism gives a rank input columns "
        r"\[0, 32\) of 64, which do not fall on the boundaries of 64-wide INT4 groups",
        id="gptq-o_proj-groups",
    ),
    pytest.param(
        "llama", int4_formats.FORMATS["gptq_act"], False,
        r"o_proj: GPTQ desc_act groups span a whole row, so its input columns \[0, 32\) of 64 "
        r"cannot be split by tensor parallelism",
        id="gptq-desc-act",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "quantization_config", "expert_parallel", "message"), REFUSED)
def test_a_slice_off_the_scale_blocks_is_refused_at_build(
    tmp_path: Path, arch: str, quantization_config: dict, expert_parallel: bool, message: str
) -> None:
    model_dir = _config_dir(tmp_path, arch, quantization_config)
    build_meta_model(model_dir)  # one rank holds it
    tp = TensorParallel(rank=0, size=TP_SIZE, expert_parallel=expert_parallel)
    with pytest.raises(UnsupportedModelError, match=message):
        build_meta_model(model_dir, tp=tp)


def test_the_engine_refuses_it_before_any_worker_starts(tmp_path: Path) -> None:
    model_dir = _config_dir(tmp_path, "llama", fp8_formats.FORMATS["fp8_block"])
    config = EngineConfig(model=model_dir, tensor_parallel_size=TP_SIZE)
    with pytest.raises(UnsupportedModelError, match=r"input columns \[0, 32\) of 64"):
        check_tensor_parallel_fit(config, model_dir)


def test_quantized_experts_take_no_replicas(checkpoints) -> None:
    """Load-aware placement (replicated experts) does not move scales yet: refused."""
    model = load_model(checkpoints["fp8-block-moe"], torch.float32, "cpu")
    fp8_block = model.model.layers[0].mlp
    assert isinstance(fp8_block, Fp8SparseMoeBlock)
    with pytest.raises(InvalidParameterError, match="load-aware' is not supported with FP8"):
        fp8_block.enable_replicas(0)
    int4_block = load_model(checkpoints["gptq-moe"], torch.float32, "cpu").model.layers[0].mlp
    assert isinstance(int4_block, Int4SparseMoeBlock)
    with pytest.raises(InvalidParameterError, match="load-aware' is not supported with INT4"):
        int4_block.enable_replicas(0)
