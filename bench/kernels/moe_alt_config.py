"""Write an alternative MoE config directory for an A/B of launch configs (gpu_check `moe_ab`).

Copies the shipped tuned files (`src/sits/kernels/configs`) to OUT_DIR and sets, in the
qwen3-30b-a3b shape's H200 file, the entry that serves 1,025-2,048 tokens back to the BLOCK_M
64 shape it had before the ninth session (the shipped entry is now the tuner's BLOCK_M 128:
bench/RESULTS.md, ninth session), so `SITS_MOE_CONFIG_DIR=OUT_DIR` runs the engine with it.

Usage (repo root): python3 bench/kernels/moe_alt_config.py OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[2] / "src" / "sits" / "kernels" / "configs"
FILE = "moe_E128_N768_bf16_NVIDIA_H200.json"
BLOCK_M_64 = {
    "BLOCK_M": 64,
    "gemm1": {"BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    "gemm2": {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
}


def write_alt_dir(out_dir: Path) -> Path:
    """Copy the shipped files to out_dir with FILE's "2048" entry replaced; returns the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in SHIPPED.glob("*.json"):
        shutil.copyfile(path, out_dir / path.name)
    target = out_dir / FILE
    table = json.loads(target.read_text())
    table["2048"] = BLOCK_M_64
    target.write_text(json.dumps(table, indent=1) + "\n")
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.splitlines()[-1])
    print(f"wrote {write_alt_dir(Path(sys.argv[1]))}")
