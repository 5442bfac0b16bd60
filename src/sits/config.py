"""`EngineConfig`: the one immutable configuration of an engine, built from CLI flags or kwargs.

Environment variables are read here only (none at import time): every variable sits reads is
named in `ENVIRONMENT_VARIABLES`, and `env_value` / `env_values` / `child_process_env` are the
only reads of the process environment. Callers hand the values on as plain mappings, so the
functions that interpret them stay pure (tests give them dicts).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from sits.core.errors import InvalidParameterError

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM's other spellings of a dtype: the config keeps the canonical name.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# vLLM's fp8_e4m3 is sits' fp8 (float8_e4m3fn with per-head scales).
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# vLLM's `--quantization` names we know of; only IMPLEMENTED_QUANTIZATION load today.
QUANTIZATION_METHODS = (
    "fp8",
    "compressed-tensors",
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "int4",
    "bitsandbytes",
    "gguf",
    "fbgemm_fp8",
    "modelopt",
    "marlin",
    "experts_int8",
    "moe_wna16",
    "torchao",
    "mxfp4",
)
IMPLEMENTED_QUANTIZATION = ("fp8", "compressed-tensors", "gptq", "awq", "int4")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine configuration; flag names follow vLLM's engine arguments.

    Attributes:
        model: checkpoint directory or Hugging Face id.
        tokenizer: tokenizer directory or id; defaults to `model`.
        served_model_name: the name clients use; defaults to `model`.
        dtype: "auto" (the checkpoint's torch_dtype; float32 on CPU for float16/bfloat16
            checkpoints unless asked), "float32", "float16" or "bfloat16"; vLLM's "half" and
            "float" are kept as "float16" and "float32".
        device: "auto" (cuda when available, else cpu), "cpu" or "cuda".
        block_size: tokens per KV block.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: most requests running at once.
        max_model_len: context length limit; defaults to the model's max_position_embeddings.
        kv_cache_memory_bytes: KV cache size; on CPU defaults to 1 GiB.
        kv_cache_dtype: KV cache storage: "auto" (the model dtype), "fp8" (float8_e4m3fn with
            per-(layer, KV head) scales; vLLM's "fp8_e4m3" is kept as "fp8") or "int8"
            (per-token-per-head scales).
        gpu_memory_utilization: on GPU, fraction of the GPU memory the engine may use in all.
        enable_prefix_caching: reuse KV blocks of identical prefixes.
        seed: seed of the engine's random source (unseeded requests draw from it).
        enforce_eager: never capture CUDA graphs.
        mixed_step_cuda_graphs: also capture whole-step graphs for steps with prompt chunks,
            one per token bucket (`runner.cuda_graphs.MixedGraphs`); on by default (CUDA
            only, and not with enforce_eager): on an H200 they took the qwen3-30b-a3b offline
            run from 4,982 to 5,485 output tok/s and a cached-prefix request's TTFT from 65.8
            to 13.6 ms (bench/RESULTS.md).
        async_scheduling: plan and launch step N+1 while the device runs step N
            (`sits.engine.async_step`): the host's scheduling and input preparation overlap
            the model; a request that ends on EOS or a stop token computes one extra decode,
            dropped. Off by default.
        swap_space: GiB of host memory (pinned on CUDA) for a host KV tier (vLLM's
            `--swap-space`; the CLI's `--cpu-offload-gb` is its deprecated alias): preempted
            requests swap their blocks out and back instead of recomputing when cheaper.
            0 (the default): no host tier, recompute-only preemption. Any kv_cache_dtype:
            quantized blocks are copied as stored (data and int8 scales).
        load_format: "auto" (the checkpoint's safetensors), "safetensors", or "dummy":
            seeded random weights (`seed`) made directly on the device from config.json alone,
            for benchmarks of real shapes without downloads (`sits.models.dummy`).
        revision: the Hub revision (branch, tag or commit) of a model given by id; None:
            the default branch. Also the tokenizer's when it is the model's.
        download_dir: the Hugging Face cache directory to look in and download to; None:
            huggingface_hub's default ($HF_HOME/hub).
        skip_tokenizer_init: load no tokenizer: prompts must be token ids and outputs carry
            token ids only (empty text); stop strings are refused.
        tpot_pacing_fraction: TPOT pacing spaces each paced request's tokens by this fraction
            of its tenant's tpot_ms, in (0, 1] (`sched.step_policy.TpotPacer.target_fraction`):
            lower keeps more margin for what the client waits for beyond the engine, higher
            lets steps carry more prefill, hence more throughput.
        tpot_pacing_min_prefill_tokens: a paced step takes prompt tokens only when at least
            this many fit its time; below, it runs its decodes alone and banks the time for a
            larger step (`sched.step_policy.TpotPacer.min_prefill_tokens`). 0 (the default): off.
            Pays where a step's cost is concave in its tokens (a few large steps cost less
            than many middle-sized ones); `bench/qos_sim.py` compares both on a cost curve.
        quantization: weight quantization, vLLM's names: None (the default: what the
            checkpoint's `quantization_config` says, or unquantized), "fp8" (an FP8
            checkpoint, or online FP8 of an unquantized one: per-channel weight scales made
            at load), "compressed-tensors" (its FP8 float-quantized and INT4 pack-quantized
            checkpoints), "gptq" / "awq" (their 4-bit checkpoints) or "int4" (online
            symmetric group-wise INT4 of an unquantized checkpoint, group 128). Other names
            (bitsandbytes, gguf, marlin, ...) are refused (`sits.layers.quant.config`).
        num_spare_experts: spare expert weight slots per MoE layer (0, the default: none, no
            extra memory). With N > 0 an expert frozen by the health check is reloaded from
            the checkpoint into a spare slot, routed there and unfrozen automatically
            (`sits.layers.expert_slots`); ignored for dense models. With tensor parallelism
            every rank's spare slots hold its slice of the restored expert; refused with
            enable_expert_parallel (a spare would have to sit on its expert's rank).
        precision_switch: None (the default: one weight set) or "fp8" / "int4": keep a
            low-precision twin of the model-dtype weights resident too (online quantization
            of an unquantized checkpoint, `sits.models.precision_twin`) and let the operator
            switch which set runs between two steps (`AsyncLLM.set_precision`). Refused with
            `quantization` set (the checkpoint's own scheme is checked at load).
        cpu_threads: torch's intra-op threads on a CPU device (`cpu_threads_of`): None (the
            default) = $SITS_CPU_THREADS, else torch's own count when OMP_NUM_THREADS or
            MKL_NUM_THREADS is set, else DEFAULT_CPU_THREADS; 0 = leave torch's setting as
            it is (e.g. your own `torch.set_num_threads`); N > 0 = N threads.
        tensor_parallel_size: ranks the model runs on (vLLM's `--tensor-parallel-size`):
            1 (the default) = this process alone; N > 1 = this process is rank 0 (it
            schedules) and N - 1 worker processes run every step with it
            (`sits.runner.tp_executor`): gloo on a CPU, NCCL on N CUDA devices from rank 0's
            on, ordered and CPU-bound by the GPU topology (`sits.parallel.topology`).
            With N > 1, precision_switch and async_scheduling with expert_router_policy
            "load-aware" are refused and CUDA graphs are not captured (every step runs
            eagerly); the MoE health check, the expert operations and spare experts work
            on every rank alike.
        enable_expert_parallel: vLLM's `--enable-expert-parallel`: with tensor_parallel_size
            N, every MoE layer places its experts whole on the ranks (rank r holds experts
            [r * E / N, (r + 1) * E / N); N must divide E, refused at load with the numbers)
            instead of slicing every expert; attention and dense layers stay tensor
            parallel. A dense model, or N = 1, runs as without it (a log line says so for
            a dense model). With N > 1 spare experts are refused; the health check freezes
            and restores experts as without it (each rank its own experts).
        tensor_parallel_timeout_s: seconds a collective between the ranks may wait (the
            gloo/NCCL timeout) before the step fails with `TensorParallelWorkerError`: a hung
            worker fails the engine within this time.
        expert_router_policy: where expert parallelism puts the experts: "static" (the
            default: rank r holds experts [r * E / N, (r + 1) * E / N)) or "load-aware"
            (`sits.runner.expert_placement`: every expert_rebalance_interval steps the
            placement is recomputed from the experts' recent token counts, hot experts
            getting replicas on other ranks, between steps while requests keep running;
            tokens unchanged). load-aware needs enable_expert_parallel with
            tensor_parallel_size > 1.
        num_redundant_experts: vLLM's EPLB name: extra expert slots per MoE layer over all
            ranks (a multiple of tensor_parallel_size; (E + N) / size slots per rank), which
            load-aware fills with replicas of the hottest experts; 0 (the default): the
            placement only moves whole experts. Only with load-aware.
        expert_rebalance_interval: steps between two re-placements (vLLM's EPLB step
            interval; the window of counts each one reads), >= 1.
    """

    model: str
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False
    mixed_step_cuda_graphs: bool = True
    async_scheduling: bool = False
    swap_space: float = 0
    load_format: str = "auto"
    revision: str | None = None
    download_dir: str | None = None
    skip_tokenizer_init: bool = False
    num_spare_experts: int = 0
    quantization: str | None = None
    precision_switch: str | None = None
    tpot_pacing_fraction: float = 0.9
    tpot_pacing_min_prefill_tokens: int = 0
    cpu_threads: int | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    tensor_parallel_timeout_s: float = 60.0
    expert_router_policy: str = "static"
    num_redundant_experts: int = 0
    expert_rebalance_interval: int = 3000

    def __post_init__(self) -> None:
        # vLLM's aliases become the canonical names while the config is built.
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        kv_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        object.__setattr__(self, "kv_cache_dtype", kv_dtype)
        if self.dtype not in _DTYPES:
            raise InvalidParameterError(
                "dtype", f"dtype must be one of {_DTYPES}, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise InvalidParameterError(
                "kv_cache_dtype",
                f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES} (or fp8_e4m3, which is fp8; "
                f"fp8_e5m2 is not supported), got {self.kv_cache_dtype!r}",
            )
        if self.load_format not in LOAD_FORMATS:
            raise InvalidParameterError(
                "load_format",
                f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}",
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise InvalidParameterError(
                "device", f"device must be auto, cpu or cuda, got {self.device!r}"
            )
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"{name} must be >= 1")
        if self.num_spare_experts < 0:
            raise InvalidParameterError(
                "num_spare_experts", f"num_spare_experts must be >= 0, got {self.num_spare_experts}"
            )
        if self.quantization is not None:
            _check_quantization(self.quantization)
        if self.precision_switch is not None:
            _check_precision_switch(self.precision_switch, self.quantization)
            if self.num_spare_experts:
                raise InvalidParameterError(
                    "precision_switch",
                    "precision_switch cannot be combined with num_spare_experts (an expert "
                    "restored into a spare slot would leave the low-precision twin stale)",
                )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidParameterError("max_model_len", "max_model_len must be >= 1")
        if not 0 <= self.tpot_pacing_min_prefill_tokens <= self.max_num_batched_tokens:
            raise InvalidParameterError(
                "tpot_pacing_min_prefill_tokens",
                f"tpot_pacing_min_prefill_tokens must be in [0, max_num_batched_tokens "
                f"{self.max_num_batched_tokens}], got {self.tpot_pacing_min_prefill_tokens}",
            )
        if not 0 < self.tpot_pacing_fraction <= 1:
            raise InvalidParameterError(
                "tpot_pacing_fraction",
                f"tpot_pacing_fraction must be in (0, 1], got {self.tpot_pacing_fraction}",
            )
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise InvalidParameterError(
                "cpu_threads", f"cpu_threads must be >= 0, got {self.cpu_threads}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidParameterError("gpu_memory_utilization", "must be in (0, 1]")
        if not (math.isfinite(self.swap_space) and self.swap_space >= 0):
            raise InvalidParameterError(
                "swap_space", f"swap_space must be >= 0, got {self.swap_space}"
            )
        _check_tensor_parallel(self)
        _check_expert_placement(self)

    @property
    def hub_options(self) -> dict[str, str | None]:
        """`resolve_model_path`'s Hub arguments: the revision and the download directory."""
        return {"revision": self.revision, "download_dir": self.download_dir}

    def with_changes(self, **changes: object) -> EngineConfig:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


PRECISION_SWITCH_SCHEMES = ("fp8", "int4")


def _check_tensor_parallel(config: EngineConfig) -> None:
    """Refuse a tensor_parallel_size below 1, a timeout that is not a positive number of
    seconds, and with more than one rank the features the executor does not carry to its
    workers yet (`sits.runner.tp_executor`).

    Raises:
        InvalidParameterError: as said, naming the field and its value.
    """
    size = config.tensor_parallel_size
    if size < 1:
        raise InvalidParameterError(
            "tensor_parallel_size", f"tensor_parallel_size must be >= 1, got {size}"
        )
    timeout_s = config.tensor_parallel_timeout_s
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise InvalidParameterError(
            "tensor_parallel_timeout_s",
            f"tensor_parallel_timeout_s must be > 0 seconds, got {timeout_s}",
        )
    if size == 1:
        return
    if config.async_scheduling and config.expert_router_policy == "load-aware":
        raise InvalidParameterError(
            "async_scheduling",
            "async_scheduling is not supported with expert_router_policy 'load-aware' yet "
            "(experts are re-placed before synchronous steps only)",
        )
    if config.precision_switch is not None:
        raise InvalidParameterError(
            "precision_switch",
            f"precision_switch is not supported with tensor_parallel_size {size} yet (only with 1)",
        )
    if config.num_spare_experts and config.enable_expert_parallel:
        raise InvalidParameterError(
            "num_spare_experts",
            f"num_spare_experts {config.num_spare_experts} is not supported with "
            f"enable_expert_parallel (tensor_parallel_size {size}): a spare slot would have "
            "to sit on the rank holding its expert, while the spare table maps every expert "
            "into one rank's slots (and load-aware's replica tables already place experts "
            "across the ranks' slots)",
        )


EXPERT_ROUTER_POLICIES = ("static", "load-aware")


def _check_expert_placement(config: EngineConfig) -> None:
    """Refuse an unknown expert_router_policy, load-aware without expert parallelism over
    several ranks, redundant experts without load-aware or not a multiple of the ranks, and
    an interval below 1 step.

    Raises:
        InvalidParameterError: as said, naming the field and the numbers.
    """
    policy, size = config.expert_router_policy, config.tensor_parallel_size
    num_redundant = config.num_redundant_experts
    if policy not in EXPERT_ROUTER_POLICIES:
        raise InvalidParameterError(
            "expert_router_policy",
            f"expert_router_policy must be one of {EXPERT_ROUTER_POLICIES}, got {policy!r}",
        )
    if config.expert_rebalance_interval < 1:
        raise InvalidParameterError(
            "expert_rebalance_interval",
            f"expert_rebalance_interval must be >= 1 step, got {config.expert_rebalance_interval}",
        )
    if policy == "load-aware" and not (config.enable_expert_parallel and size > 1):
        raise InvalidParameterError(
            "expert_router_policy",
            f"expert_router_policy 'load-aware' needs enable_expert_parallel with "
            f"tensor_parallel_size > 1, got enable_expert_parallel="
            f"{config.enable_expert_parallel} and tensor_parallel_size {size}",
        )
    if num_redundant < 0 or (num_redundant and policy != "load-aware"):
        raise InvalidParameterError(
            "num_redundant_experts",
            f"num_redundant_experts must be >= 0 and needs expert_router_policy 'load-aware', "
            f"got {num_redundant} with {policy!r}",
        )
    if num_redundant % size:
        raise InvalidParameterError(
            "num_redundant_experts",
            f"num_redundant_experts {num_redundant} must be a multiple of the expert-parallel "
            f"size (tensor_parallel_size {size})",
        )


def _check_precision_switch(scheme: str, quantization: str | None) -> None:
    """Refuse a `precision_switch` that is not an online scheme, or one given together with
    `quantization` (the switch needs the model-dtype weights).

    Raises:
        InvalidParameterError: as said.
    """
    if scheme not in PRECISION_SWITCH_SCHEMES:
        raise InvalidParameterError(
            "precision_switch",
            f"precision_switch must be one of {PRECISION_SWITCH_SCHEMES}, got {scheme!r}",
        )
    if quantization is not None:
        raise InvalidParameterError(
            "precision_switch",
            f"precision_switch {scheme!r} keeps the model-dtype weights beside their {scheme} "
            f"twin and cannot be combined with quantization {quantization!r}",
        )


def _check_quantization(name: str) -> None:
    """Refuse an unknown or unimplemented `quantization` name (what was found, what works).

    Raises:
        InvalidParameterError: the name is not one of IMPLEMENTED_QUANTIZATION.
    """
    if name in IMPLEMENTED_QUANTIZATION:
        return
    supported = f"supported: {', '.join(IMPLEMENTED_QUANTIZATION)}"
    if name in QUANTIZATION_METHODS:
        message = f"quantization {name!r} is not supported yet; {supported}"
    else:
        known = ", ".join(QUANTIZATION_METHODS)
        message = f"unknown quantization {name!r} (vLLM names: {known}); {supported}"
    raise InvalidParameterError("quantization", message)


CACHE_DIR_ENV = "SITS_CACHE_DIR"
API_KEY_ENV = "SITS_API_KEY"
ADMIN_KEY_ENV = "SITS_ADMIN_KEY"
ROUTER_KEY_ENV = "SITS_ROUTER_KEY"
OPENAI_API_KEY_ENV = "OPENAI_API_KEY"
MOE_CONFIG_DIR_ENV = "SITS_MOE_CONFIG_DIR"
STEP_SHAPES_ENV = "SITS_STEP_SHAPES_FILE"
PROFILE_STEPS_ENV = "SITS_PROFILE_STEPS"
PROFILE_FILE_ENV = "SITS_PROFILE_FILE"
OTEL_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
OTEL_SAMPLER_ARG_ENV = "OTEL_TRACES_SAMPLER_ARG"
OTEL_SDK_DISABLED_ENV = "OTEL_SDK_DISABLED"
OTEL_PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
TRACING_ENVS = (
    *OTEL_ENDPOINT_ENVS,
    OTEL_SAMPLER_ARG_ENV,
    OTEL_SDK_DISABLED_ENV,
    *OTEL_PROTOCOL_ENVS,
)
CPU_THREADS_ENV = "SITS_CPU_THREADS"
TORCH_THREADS_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
CPU_THREADS_ENVS = (CPU_THREADS_ENV, *TORCH_THREADS_ENVS)
# One thread: on a 2-core machine torch's default (2) gave 81-984 output tok/s, varying with
# the other load, and 1 thread 1,105-1,263 (`sits bench throughput --random-weights
# tiny-llama`, 32 x 64 in / 64 out; README "CPU threads").
DEFAULT_CPU_THREADS = 1

ENVIRONMENT_VARIABLES: dict[str, str] = {
    CACHE_DIR_ENV: "directory of locally made artifacts (the demo model; ~/.cache/sits)",
    API_KEY_ENV: "`sits serve`'s bearer key when --api-key is not given",
    ADMIN_KEY_ENV: "`sits serve`'s admin key when --admin-key is not given",
    ROUTER_KEY_ENV: "the fleet router's key (`sits router`, `sits serve --register-with`)",
    OPENAI_API_KEY_ENV: "`sits bench serve`'s key for the server under test",
    MOE_CONFIG_DIR_ENV: "another directory of tuned fused-MoE configs (A/B of configs)",
    STEP_SHAPES_ENV: "file the engine appends each step's shape to (for replays)",
    PROFILE_STEPS_ENV: "START:COUNT, engine steps to run under torch.profiler",
    PROFILE_FILE_ENV: "where the step profile goes (sits-profile-PID.txt)",
    OTEL_ENDPOINT_ENVS[0]: "OpenTelemetry: OTLP endpoint of traces (turns tracing on)",
    OTEL_ENDPOINT_ENVS[1]: "OpenTelemetry: OTLP endpoint (turns tracing on)",
    OTEL_SAMPLER_ARG_ENV: "OpenTelemetry: the traces' sample ratio",
    OTEL_SDK_DISABLED_ENV: "OpenTelemetry: 'true' turns tracing off",
    OTEL_PROTOCOL_ENVS[0]: "OpenTelemetry: OTLP protocol of traces (grpc or http/protobuf)",
    OTEL_PROTOCOL_ENVS[1]: "OpenTelemetry: OTLP protocol (grpc or http/protobuf)",
    CPU_THREADS_ENV: "torch threads of the engine on a CPU (default 1; 0: torch's own count)",
    TORCH_THREADS_ENVS[0]: "OpenMP threads: when set, the engine keeps torch's thread count",
    TORCH_THREADS_ENVS[1]: "MKL threads: when set, the engine keeps torch's thread count",
}


def env_value(name: str) -> str | None:
    """The process environment's value of variable `name` (one of `ENVIRONMENT_VARIABLES`),
    None when unset."""
    assert name in ENVIRONMENT_VARIABLES, f"{name} is not in ENVIRONMENT_VARIABLES"
    return os.environ.get(name)


def env_values(*names: str) -> dict[str, str]:
    """The variables of `names` (each one of `ENVIRONMENT_VARIABLES`) that are set, by name."""
    values = {name: env_value(name) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def child_process_env(*, without: Iterable[str] = ()) -> dict[str, str]:
    """A copy of the whole process environment for a child process, less the `without` names."""
    dropped = set(without)
    return {name: value for name, value in os.environ.items() if name not in dropped}


def sits_cache_dir() -> str:
    """Directory for locally made artifacts (demo model): $SITS_CACHE_DIR or ~/.cache/sits."""
    return env_value(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "sits")


def cpu_threads_of(cpu_threads: int | None, env: Mapping[str, str]) -> int | None:
    """The torch intra-op thread count the engine sets on a CPU device; None: leave torch's.

    The first of: `cpu_threads` when given; $SITS_CPU_THREADS; torch's own count (None) when
    OMP_NUM_THREADS or MKL_NUM_THREADS is set (the user chose, and torch follows them);
    DEFAULT_CPU_THREADS. A 0 from `cpu_threads` or $SITS_CPU_THREADS also gives None.

    Args:
        cpu_threads: `EngineConfig.cpu_threads`.
        env: the set variables of CPU_THREADS_ENVS by name (`env_values(*CPU_THREADS_ENVS)`).

    Raises:
        InvalidParameterError: $SITS_CPU_THREADS is not an integer >= 0.
    """
    if cpu_threads is None and CPU_THREADS_ENV in env:
        text = env[CPU_THREADS_ENV].strip()
        if not text.isdigit():
            raise InvalidParameterError(
                "cpu_threads", f"{CPU_THREADS_ENV} must be an integer >= 0, got {text!r}"
            )
        cpu_threads = int(text)
    if cpu_threads is None:
        return None if any(name in env for name in TORCH_THREADS_ENVS) else DEFAULT_CPU_THREADS
    return cpu_threads or None
