"""Launch configurations of the fused MoE kernels, per token count, from tuned JSON files.

A file `configs/moe_E{E}_N{N}_{dtype}_{gpu}.json` beside this module (E experts, N the expert
width I, dtype bf16/fp16/fp32 or fp8_w8a8 (the FP8 experts of `moe_fp8_triton`, keyed by
`torch.float8_e4m3fn`), gpu the CUDA device name with spaces as underscores, e.g.
`moe_E128_N768_bf16_NVIDIA_H200.json`) maps token counts (string keys, "1" ... "8192") to a
config. An entry is either flat (one shape for both GEMMs)
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
or split per GEMM (BLOCK_M is shared: the alignment pads every expert to it)
    {"BLOCK_M": 16, "gemm1": {"BLOCK_N": ..., ...}, "gemm2": {...}}.

Invariants:
- A step with T tokens uses the entry of the smallest key >= T (the largest key when T is
  larger than all); without a file, `default_config` (a heuristic on rows per expert; for
  fp8_w8a8 with BLOCK_K 128, one K step per activation group and weight scale block).
- Files are read when first needed, never at import; `MoeConfigStore` caches them per instance.
- `bench/kernels/moe_tune.py` writes these files; SITS_MOE_CONFIG_DIR points the engine at
  another directory of them (e.g. to compare two configs on the same workload).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sits.config import MOE_CONFIG_DIR_ENV, env_value
from sits.core.errors import InvalidParameterError

CONFIG_DIR = Path(__file__).parent / "configs"
DTYPE_NAMES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float8_e4m3fn: "fp8_w8a8",  # FP8 weights and activations (vLLM's dtype=fp8_w8a8)
}


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """Launch shape of one grouped GEMM.

    Attributes:
        block_n: output columns per program (power of two >= 16).
        block_k: reduction step (power of two >= 16).
        group_m: row blocks swept together for L2 reuse of weight tiles (>= 1).
        num_warps, num_stages: Triton launch parameters.
    """

    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise InvalidParameterError(name, f"must be a power of two >= 16, got {value}")
        for name in ("group_m", "num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, f"must be >= 1, got {getattr(self, name)}")

    def to_json(self) -> dict[str, int]:
        """The tuned-file entry of this GEMM: BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages."""
        return {
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }

    @classmethod
    def from_json(cls, entry: dict) -> GemmConfig:
        """Parse a `to_json` entry (GROUP_M, num_warps, num_stages optional).

        Raises:
            KeyError: BLOCK_N or BLOCK_K missing; InvalidParameterError: a bad value.
        """
        return cls(
            block_n=int(entry["BLOCK_N"]),
            block_k=int(entry["BLOCK_K"]),
            group_m=int(entry.get("GROUP_M", 1)),
            num_warps=int(entry.get("num_warps", 4)),
            num_stages=int(entry.get("num_stages", 3)),
        )


@dataclass(frozen=True, slots=True)
class MoeLaunchConfig:
    """Launch shapes of one fused MoE call.

    Attributes:
        block_m: rows (token-expert pairs) per block, shared by the alignment and both GEMMs
            (power of two >= 16).
        gemm1: the [rows, H] x [H, 2I] GEMM with SiLU(gate) * up in its epilogue.
        gemm2: the [rows, I] x [I, H] GEMM.
    """

    block_m: int
    gemm1: GemmConfig
    gemm2: GemmConfig

    def __post_init__(self) -> None:
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise InvalidParameterError("block_m", f"must be a power of two >= 16: {self.block_m}")

    def to_json(self) -> dict:
        """The tuned-file entry: BLOCK_M and one `GemmConfig.to_json` per GEMM."""
        return {
            "BLOCK_M": self.block_m,
            "gemm1": self.gemm1.to_json(),
            "gemm2": self.gemm2.to_json(),
        }

    @classmethod
    def from_json(cls, entry: dict) -> MoeLaunchConfig:
        """Parse a flat or per-GEMM entry (module docstring)."""
        if "gemm1" in entry:
            gemm1, gemm2 = (
                GemmConfig.from_json(entry["gemm1"]),
                GemmConfig.from_json(entry["gemm2"]),
            )
        else:
            gemm1 = gemm2 = GemmConfig.from_json(entry)
        return cls(int(entry["BLOCK_M"]), gemm1, gemm2)


def default_config(
    num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype | None = None
) -> MoeLaunchConfig:
    """Heuristic when no tuned file exists, by the mean rows per expert (T * k / E).

    Few rows (decode): BLOCK_M 16 and narrow column tiles, so that many programs stream the
    touched experts' weights; many rows (prefill): 128 x 128 tiles for the tensor cores.
    dtype float8_e4m3fn (fp8_w8a8): BLOCK_K 128 throughout (128 one-byte elements per row
    step, and it divides the 128-wide activation groups and weight scale blocks).
    """
    wide_k = 128 if dtype == torch.float8_e4m3fn else 64
    rows_per_expert = num_tokens * top_k / max(1, num_experts)
    if rows_per_expert <= 16:
        narrow = GemmConfig(block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return MoeLaunchConfig(16, narrow, narrow)
    if rows_per_expert <= 96:
        mid = GemmConfig(block_n=64, block_k=wide_k, group_m=8, num_warps=4, num_stages=4)
        return MoeLaunchConfig(64, mid, mid)
    wide = GemmConfig(block_n=128, block_k=wide_k, group_m=8, num_warps=8, num_stages=3)
    return MoeLaunchConfig(128, wide, wide)


def device_name_of(device: torch.device) -> str:
    """File-name form of a device: the CUDA device name with runs of other characters as '_'
    ("NVIDIA H200" -> "NVIDIA_H200"); "cpu" for the CPU."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


def config_file_name(num_experts: int, intermediate_size: int, dtype: torch.dtype, gpu: str) -> str:
    """`moe_E{E}_N{N}_{dtype}_{gpu}.json` (see module docstring)."""
    dtype_name = DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return f"moe_E{num_experts}_N{intermediate_size}_{dtype_name}_{gpu}.json"


def load_config_table(path: Path) -> dict[int, MoeLaunchConfig]:
    """Read a tuned file: token count -> config.

    Raises:
        InvalidParameterError: the file is not a JSON object of token counts to entries.
    """
    try:
        raw = json.loads(Path(path).read_text())
        return {int(key): MoeLaunchConfig.from_json(entry) for key, entry in raw.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise InvalidParameterError("moe_config", f"bad MoE config file {path}: {error}") from error


def pick_config(table: dict[int, MoeLaunchConfig], num_tokens: int) -> MoeLaunchConfig:
    """The entry of the smallest key >= num_tokens, else of the largest key."""
    keys = sorted(table)
    for key in keys:
        if key >= num_tokens:
            return table[key]
    return table[keys[-1]]


class MoeConfigStore:
    """Finds and caches tuned config tables (one per shape, dtype and device).

    Args:
        config_dir: where the JSON files live (default: the environment variable
            SITS_MOE_CONFIG_DIR, read here, else `configs/` beside this module). A directory
            without a file for the shape falls back to `default_config`, not to `configs/`.
    """

    def __init__(self, config_dir: str | Path | None = None) -> None:
        if config_dir is None:
            config_dir = env_value(MOE_CONFIG_DIR_ENV) or CONFIG_DIR
        self.config_dir = Path(config_dir)
        self._tables: dict[tuple, dict[int, MoeLaunchConfig] | None] = {}

    def table(
        self, num_experts: int, intermediate_size: int, dtype: torch.dtype, device: torch.device
    ) -> dict[int, MoeLaunchConfig] | None:
        """The tuned table for the shape, or None when no file exists."""
        key = (num_experts, intermediate_size, dtype, device.type, device.index)
        if key not in self._tables:
            name = config_file_name(num_experts, intermediate_size, dtype, device_name_of(device))
            path = self.config_dir / name
            self._tables[key] = load_config_table(path) if path.is_file() else None
        return self._tables[key]

    def select(
        self,
        num_tokens: int,
        top_k: int,
        num_experts: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> MoeLaunchConfig:
        """The tuned config for num_tokens, or `default_config` when no file exists; dtype is
        the GEMM operands' (the activations', or float8_e4m3fn for fp8_w8a8)."""
        table = self.table(num_experts, intermediate_size, dtype, device)
        if not table:
            return default_config(num_tokens, top_k, num_experts, dtype)
        return pick_config(table, num_tokens)
