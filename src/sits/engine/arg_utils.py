"""Engine flags shared by `sits generate`, `sits serve` and the benchmarks (vLLM names).

Argument plumbing only: `add_engine_args` declares the flags, `engine_kwargs` maps them onto
`EngineConfig` keyword arguments (which validates them). vLLM's flags that have no effect in
sits (`--trust-remote-code`, `--enable-chunked-prefill`) are accepted and logged, and
`--cpu-offload-gb` is the deprecated alias of `--swap-space` (the host KV tier). It sits in
`engine`, below both `cli` and `sits.bench`, so the benchmarks' library reuses it without
importing `cli`.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sits.config import EXPERT_ROUTER_POLICIES
from sits.core.errors import InvalidParameterError

logger = logging.getLogger(__name__)

# The default of `--engine-step-timeout` (`AsyncLLM.step_timeout_s`, `hung_loop_error`); here, in
# a module that imports nothing heavy, so `sits serve` reads it without loading the engine.
ENGINE_STEP_TIMEOUT_S = 60.0  # as vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S


def add_engine_args(parser: argparse.ArgumentParser, *, model_required: bool) -> None:
    """Add the `EngineConfig` flags to a parser."""
    parser.add_argument(
        "--model",
        required=model_required,
        default=None,
        help="Hugging Face checkpoint directory (or a model id already in the local cache)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or id (default: the model's)"
    )
    parser.add_argument(
        "--revision",
        default=None,
        help="the Hub revision (branch, tag or commit) of a model given by id (default: the "
        "default branch); also the tokenizer's when it is the model's",
    )
    parser.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="the Hugging Face cache directory to look for and download models in (default: "
        "huggingface_hub's, $HF_HOME/hub)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM's command lines; sits runs no code from a checkpoint: its "
        "architectures are built in, and others are refused",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
        help="weights and activations (auto: the checkpoint's torch_dtype; float32 on a CPU); "
        "half = float16, float = float32",
    )
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda if present"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one engine step (prompt chunks and decodes together)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="most requests running at once"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context length)",
    )
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="bytes of KV cache (default: what --gpu-memory-utilization leaves on a GPU; "
        "1 GiB on a CPU)",
    )
    # No argparse `choices`: EngineConfig validates (InvalidParameterError naming the field).
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache storage: auto (model dtype), fp8 or fp8_e4m3 (e4m3, per-head scales) "
        "or int8",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU's memory for weights, activations and KV cache",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes (on by default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and dummy weights")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs (every step runs eagerly)"
    )
    parser.add_argument(
        "--mixed-step-cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also replay steps that carry prompt tokens from CUDA graphs, one captured per step "
        "size (64 to 512 tokens by powers of two, then every 256 up to 2048 and every 512 up to "
        "--max-num-batched-tokens): removes the kernel-launch "
        "cost of eager prefill steps. On by default, CUDA only; --no-mixed-step-cuda-graphs "
        "saves their capture time and memory at startup; --enforce-eager turns all graphs off",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="plan and launch the next step while the device runs this one, so the host's "
        "scheduling overlaps the model (as vLLM's --async-scheduling); requests with "
        "logprobs or penalties run their steps synchronously. Off by default",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="accepted for vLLM's command lines: sits always splits long prompts into chunks "
        "of --max-num-batched-tokens; --no-enable-chunked-prefill is refused",
    )
    parser.add_argument(
        "--swap-space",
        type=float,
        default=None,
        metavar="GIB",
        help="GiB of host memory for swapped-out KV blocks, the host KV tier (default 0: "
        "recompute-only preemption)",
    )
    parser.add_argument(
        "--cpu-offload-gb",
        type=float,
        default=None,
        metavar="GIB",
        help="deprecated alias of --swap-space (in vLLM this flag offloads weights, which sits "
        "does not do)",
    )
    parser.add_argument(
        "--load-format",
        default="auto",
        help="weights: auto (the checkpoint's safetensors), safetensors, or dummy (seeded "
        "random weights made on the device from config.json, for benchmarks)",
    )
    parser.add_argument(
        "--num-spare-experts",
        type=int,
        default=0,
        help="spare expert weight slots per MoE layer: an expert frozen by the health check is "
        "reloaded from the checkpoint into one and unfrozen automatically (0: none)",
    )
    parser.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="weight quantization (vLLM names): default, what the checkpoint's "
        "quantization_config says; fp8 (FP8 checkpoints, or online FP8 of a bf16/fp32 one), "
        "compressed-tensors (FP8 float-quantized, INT4 pack-quantized), gptq, awq (4-bit), or "
        "int4 (online symmetric INT4, group 128, of a bf16/fp32 one)",
    )
    parser.add_argument(
        "--precision-switch",
        choices=("fp8", "int4"),
        default=None,
        help="keep an fp8 or int4 twin of the weights resident beside the model-dtype ones "
        "(online quantization of an unquantized checkpoint; both sets' memory is counted "
        "before the KV cache) and switch between them while serving (POST "
        "/v1/admin/precision); not with --quantization",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks the model runs on: this process and N-1 workers, one per GPU (NCCL; "
        "ordered and bound to CPU cores by the GPU topology) or over gloo on a CPU; 1 (the "
        "default): this process alone. With N > 1 steps run eagerly; --precision-switch, "
        "--engine-process and --async-scheduling with --expert-router-policy load-aware are "
        "refused",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="place each MoE layer's experts whole on the tensor-parallel ranks (expert "
        "parallel size = --tensor-parallel-size, which must divide the experts) instead of "
        "slicing every expert; attention and dense layers stay tensor parallel; a dense model "
        "runs as without it",
    )
    parser.add_argument(
        "--expert-router-policy",
        choices=EXPERT_ROUTER_POLICIES,
        default="static",
        help="with --enable-expert-parallel and -tp N > 1: static (the default: E / N "
        "experts per rank, fixed) or load-aware (every --expert-rebalance-interval steps the "
        "placement is recomputed from the experts' recent token counts, hot experts get "
        "replicas in the --num-redundant-experts slots; requests keep running)",
    )
    parser.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="load-aware: extra expert slots per MoE layer over all ranks, a multiple of -tp, "
        "for replicas of hot experts (default 0: only whole experts move)",
    )
    parser.add_argument(
        "--expert-rebalance-interval",
        type=int,
        default=3000,
        help="load-aware: steps between two re-placements (default 3000)",
    )
    parser.add_argument(
        "--tensor-parallel-timeout",
        type=float,
        default=60.0,
        help="seconds a collective between the ranks may wait before the engine fails (a dead "
        "or hung rank then fails every open request); default 60",
    )
    parser.add_argument(
        "--tpot-pacing-fraction",
        type=float,
        default=0.9,
        help="with tenants that have tpot_ms: space their tokens by this fraction of it, in "
        "(0, 1] (0.9); higher lets steps carry more prompt tokens (throughput), lower keeps "
        "more margin under the SLO",
    )
    parser.add_argument(
        "--tpot-pacing-min-prefill-tokens",
        type=int,
        default=0,
        help="a paced step takes prompt tokens only when at least this many fit, else it runs "
        "its decodes alone and banks the time for a larger step (default 0: off)",
    )


def swap_space_arg(args: argparse.Namespace) -> float:
    """GiB of the host KV tier: --swap-space, else its deprecated alias --cpu-offload-gb
    (logged as deprecated), else 0.

    Raises:
        InvalidParameterError("swap_space"): both flags given with different values.
    """
    swap, alias = args.swap_space, args.cpu_offload_gb
    if alias is None:
        return 0.0 if swap is None else swap
    logger.warning(
        "--cpu-offload-gb is deprecated: use --swap-space (GiB of host KV cache; in vLLM "
        "--cpu-offload-gb offloads weights)"
    )
    if swap is not None and swap != alias:
        raise InvalidParameterError(
            "swap_space",
            f"--swap-space {swap:g} and its deprecated alias --cpu-offload-gb {alias:g} disagree",
        )
    return alias


def _check_vllm_only_flags(args: argparse.Namespace) -> None:
    """Log what the vLLM flags sits accepts without an effect mean here; refuse
    --no-enable-chunked-prefill (sits always chunks).

    Raises:
        InvalidParameterError("enable_chunked_prefill"): chunked prefill turned off.
    """
    if args.trust_remote_code:
        logger.warning(
            "--trust-remote-code: sits runs no code from a checkpoint; the model's architecture "
            "must be one sits builds in (others are refused)"
        )
    if args.enable_chunked_prefill is False:
        raise InvalidParameterError(
            "enable_chunked_prefill",
            "sits always chunks prefill (each step holds at most --max-num-batched-tokens "
            "tokens): --no-enable-chunked-prefill is not supported",
        )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig` keyword arguments from parsed flags.

    Raises:
        InvalidParameterError: --no-enable-chunked-prefill, or --swap-space and
            --cpu-offload-gb disagreeing.
    """
    _check_vllm_only_flags(args)
    return {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "revision": args.revision,
        "download_dir": args.download_dir,
        "dtype": args.dtype,
        "device": args.device,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "seed": args.seed,
        "enforce_eager": args.enforce_eager,
        "mixed_step_cuda_graphs": args.mixed_step_cuda_graphs,
        "async_scheduling": args.async_scheduling,
        "swap_space": swap_space_arg(args),
        "load_format": args.load_format,
        "num_spare_experts": args.num_spare_experts,
        "quantization": args.quantization,
        "precision_switch": args.precision_switch,
        "tpot_pacing_fraction": args.tpot_pacing_fraction,
        "tpot_pacing_min_prefill_tokens": args.tpot_pacing_min_prefill_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "tensor_parallel_timeout_s": args.tensor_parallel_timeout,
        "expert_router_policy": args.expert_router_policy,
        "num_redundant_experts": args.num_redundant_experts,
        "expert_rebalance_interval": args.expert_rebalance_interval,
    }
