"""What the quantized-checkpoint tests share: writing a tiny checkpoint with a
`quantization_config`, and the prompt logits and greedy tokens a model directory gives."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from sits import LLM, SamplingParams
from sits.models.loader import load_model
from tests.models.paged import PagedRunner

PROMPT = [5, 77, 300, 12, 9, 480, 31, 64, 200, 3, 17]
PROMPTS = [[5, 17, 99, 260, 3], [400, 2, 2, 2, 71, 8, 9, 10, 11]]


def write_checkpoint(src: Path, dst: Path, weights: dict, quantization_config: dict | None) -> Path:
    """`src`'s config.json (with `quantization_config` when given) and `weights` in `dst`."""
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    return dst


def prompt_logits(model_dir: Path, **kwargs) -> torch.Tensor:
    """Float32 logits of every PROMPT position, [len(PROMPT), vocab]."""
    model = load_model(str(model_dir), torch.float32, "cpu", **kwargs)
    return PagedRunner(model).step([("a", PROMPT)])[0]


def greedy_tokens(model_dir: Path, **kwargs) -> list[list[int]]:
    """8 greedy tokens of each of PROMPTS through the engine (float32)."""
    llm = LLM(
        str(model_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=256, **kwargs
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outputs]
