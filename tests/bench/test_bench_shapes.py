"""Named shapes: directories the loader builds, with the real checkpoints' parameter counts."""

from __future__ import annotations

import json

import pytest

from sits.bench.roofline import ModelShape
from sits.bench.shapes import shape_config, shape_names, write_shape_dir
from sits.core.errors import InvalidParameterError
from sits.models.loader import build_meta_model

# Parameter counts of the Hugging Face checkpoints (model cards / safetensors metadata).
REAL_PARAMS = {
    "qwen3-30b-a3b": 30_532_122_624,
    "llama-3.1-8b": 8_030_261_248,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", shape_names())
def test_shape_builds_and_roofline_counts_match_the_model(tmp_path, name: str) -> None:
    model = build_meta_model(write_shape_dir(name, str(tmp_path)))
    num_params = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_decoder_config(model.config).total_params == num_params
    if name in REAL_PARAMS:
        assert num_params == REAL_PARAMS[name]


def test_qwen3_30b_a3b_shape() -> None:
    config = shape_config("qwen3-30b-a3b")
    assert (config["num_experts"], config["num_experts_per_tok"]) == (128, 8)
    assert (config["num_hidden_layers"], config["hidden_size"]) == (48, 2048)


def test_shape_dir_is_rewritten_when_it_differs(tmp_path) -> None:
    out = write_shape_dir("tiny-llama", str(tmp_path))
    path = tmp_path / "tiny-llama" / "config.json"
    assert out == str(tmp_path / "tiny-llama")
    path.write_text("{}")
    write_shape_dir("tiny-llama", str(tmp_path))
    assert json.loads(path.read_text()) == shape_config("tiny-llama")
    generation = json.loads((tmp_path / "tiny-llama" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": None, "eos_token_id": 0}


def test_unknown_shape_is_refused() -> None:
    with pytest.raises(InvalidParameterError) as info:
        shape_config("gpt-5")
    assert info.value.param == "random_weights"
    assert "qwen3-30b-a3b" in str(info.value)
