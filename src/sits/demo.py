"""The built-in demo model `sits-demo`, served by `sits serve` when no --model is given.

`ensure_demo_model()` returns, without any download:
1. the packaged trained checkpoint `src/sits/demo_model` when it holds a config.json;
2. otherwise a seeded random tiny Qwen3-MoE (byte-level BPE tokenizer of about 4096 ids trained
   locally, ChatML chat template, 2048-token context) built on first use into
   `sits_cache_dir()/sits-demo-random`, marked random by a `sits_demo.json` file so the server
   can say in /v1/models that its weights are random and its text is noise.
The random build is written under a temporary name and renamed when complete, so an
interrupted first run never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_NAME = "sits-demo"
MARKER_FILE = "sits_demo.json"
RANDOM_DEMO_DIR = "sits-demo-random"
RANDOM_DEMO_SEED = 1234
RANDOM_DEMO_VOCAB_SIZE = 4096
RANDOM_DEMO_CONTEXT_TOKENS = 2048
RANDOM_DESCRIPTION = (
    "sits-demo with RANDOM weights (a seeded random tiny Qwen3-MoE made locally): "
    "its text is noise; serve a real checkpoint with --model PATH."
)
TRAINED_DESCRIPTION = (
    "sits-demo: a tiny (7M-parameter) Qwen3-MoE trained only to complete Python code, and not "
    "well; not an assistant (see src/sits/demo_model/README.md)."
)


def packaged_demo_dir() -> Path:
    """The directory of the packaged (trained) demo checkpoint; it may be empty or absent."""
    return Path(__file__).resolve().parent / "demo_model"


def random_demo_dir() -> Path:
    """Where the random demo model is built: `sits_cache_dir()/sits-demo-random`."""
    from sits.config import sits_cache_dir

    return Path(sits_cache_dir()) / RANDOM_DEMO_DIR


def demo_info(path: str | os.PathLike[str]) -> dict[str, object]:
    """What the marker file says about a demo checkpoint ({} when it is not a random demo)."""
    marker = Path(path) / MARKER_FILE
    if not marker.is_file():
        return {}
    with open(marker, encoding="utf-8") as f:
        return json.load(f)


def is_random_demo(path: str | os.PathLike[str]) -> bool:
    """True when `path` is the random demo model (weights are random)."""
    return bool(demo_info(path).get("random_weights", False))


def _build_random_demo(final_dir: Path) -> None:
    from sits.testing.tiny import make_tiny_checkpoint

    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{RANDOM_DEMO_DIR}-", dir=final_dir.parent))
    try:
        make_tiny_checkpoint(
            "qwen3_moe",
            tmp_dir,
            seed=RANDOM_DEMO_SEED,
            vocab_size=RANDOM_DEMO_VOCAB_SIZE,
            max_position_embeddings=RANDOM_DEMO_CONTEXT_TOKENS,
        )
        marker = {
            "name": DEMO_MODEL_NAME,
            "random_weights": True,
            "seed": RANDOM_DEMO_SEED,
            "description": RANDOM_DESCRIPTION,
        }
        with open(tmp_dir / MARKER_FILE, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes it private; the cache is a normal directory
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not final_dir.is_dir():
            raise
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir, ignore_errors=True)


def ensure_demo_model() -> str:
    """The demo checkpoint directory, building the random one on first use.

    Returns:
        `src/sits/demo_model` when it holds a trained checkpoint (config.json), else the random
        demo model's directory in the sits cache (made now if missing; no download).
    """
    packaged = packaged_demo_dir()
    if (packaged / "config.json").is_file():
        return str(packaged)
    final_dir = random_demo_dir()
    if not (final_dir / "config.json").is_file():
        if final_dir.exists():  # a broken earlier build
            shutil.rmtree(final_dir)
        _build_random_demo(final_dir)
    return str(final_dir)
