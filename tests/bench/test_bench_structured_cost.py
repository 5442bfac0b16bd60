"""`bench/structured_cost.py` end to end on the CPU (a tiny shape, dummy weights) and its
synthetic full-size tokenizer."""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer

from sits.bench import structured_cost
from sits.bench.structured_cost import synthetic_tokenizer


def test_synthetic_tokenizer_has_the_whole_vocabulary(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path))
    path = synthetic_tokenizer(1000, [999, 3])
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 1000
    assert tokenizer.eos_token_id == 999
    assert tokenizer.convert_ids_to_tokens([3, 999]) == ["<|eos_3|>", "<|eos_999|>"]
    assert synthetic_tokenizer(1000, [999, 3]) == path  # made once


def test_passes_with_and_without_constrained_requests(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    out_json = tmp_path / "s.json"
    argv = ["--random-weights", "tiny-qwen3-moe", "--dtype", "float32", "--input-len", "8"]
    argv += ["--output-len", "6", "--num-prompts", "10", "--output-json", str(out_json)]
    monkeypatch.setattr(sys, "argv", ["bench/structured_cost.py", *argv])  # the printed command
    assert structured_cost.main(argv) == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "sits.bench.structured_cost/1"
    passes = doc["passes"]
    assert [(p["fraction"], p["num_constrained"]) for p in passes] == [(0.0, 0), (0.1, 1)]
    assert passes[0]["num_output_tokens"] == 10 * 6
    assert 0 < passes[1]["num_constrained_tokens"] <= 6
    assert doc["workload"]["tokenizer"].startswith(str(tmp_path / "cache"))
    printed = capsys.readouterr().out
    assert printed.startswith("Command: ") and "--random-weights tiny-qwen3-moe" in printed
    assert "| constrained | repeat | requests | output tokens | s | output tok/s | vs 0 % |" in (
        printed
    )
    assert "| 10 % | 0 | 1 |" in printed
