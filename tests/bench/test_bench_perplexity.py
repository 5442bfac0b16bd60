"""`sits bench perplexity`: the held-out rule, the windows, the NLL against transformers on a
tiny random checkpoint (same windows, float32), and the CLI on the demo model (few tokens)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from sits import LLM
from sits.bench.perplexity import (
    compare,
    framed_tokens,
    held_out_files,
    is_held_out,
    parse_precisions,
    perplexity,
    score_sequences,
    score_windows,
)
from sits.cli.main import main
from sits.core.errors import InvalidParameterError
from sits.demo import packaged_demo_dir

REPO = Path(__file__).resolve().parents[2]


def _demo_corpus(monkeypatch):
    """tools/demo_corpus.py, the module that split the demo model's training corpus."""
    spec = importlib.util.spec_from_file_location("demo_corpus", REPO / "tools/demo_corpus.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "demo_corpus", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("num_tokens", "window_tokens"), [(2, 2), (3, 2), (10, 4), (11, 4), (12, 4), (7, 100)]
)
def test_windows_score_every_target_exactly_once(num_tokens, window_tokens) -> None:
    windows = score_windows(num_tokens, window_tokens)
    targets = [t for start, end in windows for t in range(start + 1, end)]
    assert targets == list(range(1, num_tokens))  # each once, in order
    assert all(2 <= end - start <= window_tokens for start, end in windows)
    # Each window after the first starts on the previous window's last token (its context).
    assert all(a[1] - 1 == b[0] for a, b in zip(windows, windows[1:]))
    assert score_windows(1, window_tokens) == []


def test_windows_refuse_a_window_without_a_target() -> None:
    with pytest.raises(ValueError, match="window_tokens"):
        score_windows(10, 1)


def test_framing_and_perplexity_math() -> None:
    assert framed_tokens([5, 6, 7], 0, None) == [0, 5, 6, 7, 0]
    assert framed_tokens([5, 6, 7], 0, 2) == [0, 5, 6]
    assert perplexity([math.log(2.0), math.log(8.0)]) == pytest.approx(4.0, rel=1e-12)
    with pytest.raises(ValueError):
        perplexity([])
    results = [
        {"precision": "bf16", "perplexity": 10.0},
        {"precision": "fp8", "perplexity": 10.1},
        {"precision": "int4", "perplexity": 11.5},
    ]
    compare(results)
    assert [r["relative_diff_vs_bf16"] for r in results] == pytest.approx([0.0, 0.01, 0.15])
    assert [r["met"] for r in results] == [None, True, False]
    assert [r["target"] for r in results] == [None, 0.02, 0.10]
    assert parse_precisions("int4, bf16") == ["int4", "bf16"]
    for bad in ("", "fp16", "fp8,fp8"):
        with pytest.raises(InvalidParameterError):
            parse_precisions(bad)


def test_held_out_rule_is_the_demo_corpus_rule(monkeypatch) -> None:
    corpus = _demo_corpus(monkeypatch)
    for path in ("functools.py", "unittest/suite.py", "os.py", "asyncio/events.py", "json/x.py"):
        expected = int(hashlib.sha256(path.encode()).hexdigest(), 16) % 100 < 3
        assert is_held_out(path) == corpus.is_held_out(path, 3) == expected
    assert is_held_out("functools.py") and not is_held_out("os.py")
    split = corpus.read_stdlib(3, 0)
    assert [(f.rel_path, f.text) for f in held_out_files()] == split.held_out


def _hf_window_nlls(model_dir: Path, seq: list[int], window_tokens: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    nlls: list[float] = []
    with torch.no_grad():
        for start, end in score_windows(len(seq), window_tokens):
            window = torch.tensor([seq[start:end]])  # [1, n]
            logprobs = torch.log_softmax(model(window).logits[0].float(), dim=-1)  # [n, vocab]
            targets = window[0, 1:]
            nlls += (-logprobs[:-1].gather(1, targets[:, None])[:, 0]).tolist()
    return nlls


def test_nll_equals_transformers_on_the_same_windows(tiny_model_factory) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    rng = random.Random(0)
    sequences = [[rng.randrange(512) for _ in range(n)] for n in (30, 7, 12)]
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=12,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
    )
    window_tokens = llm.max_model_len - 1
    got = score_sequences(llm, sequences, window_tokens)
    for seq, nlls in zip(sequences, got):
        want = _hf_window_nlls(model_dir, seq, window_tokens)
        assert len(nlls) == len(seq) - 1
        assert nlls == pytest.approx(want, rel=1e-4)
        assert perplexity(nlls) == pytest.approx(perplexity(want), rel=1e-4)


def test_cli_on_the_demo_model_prints_the_table(tmp_path, capsys, monkeypatch) -> None:
    if not (packaged_demo_dir() / "config.json").is_file():
        pytest.skip("the trained demo model is not packaged")
    out_json = tmp_path / "ppl.json"
    argv = ["bench", "perplexity", "--max-tokens-per-file", "64", "--max-files", "2"]
    argv += ["--output-json", str(out_json)]
    monkeypatch.setattr("sys.argv", ["sits", *argv])
    assert main(argv) == 0
    doc = json.loads(out_json.read_text())
    assert doc["schema"] == "sits.bench.perplexity/1"
    assert doc["model"]["dtype"] == "bfloat16"
    assert len(doc["files"]) == 2
    assert all(f["num_scored_tokens"] == 64 and is_held_out(f["path"]) for f in doc["files"])
    results = {r["precision"]: r for r in doc["results"]}
    assert list(results) == ["bf16", "fp8", "int4"]
    for r in results.values():
        assert r["num_scored_tokens"] == 128
        assert r["perplexity"] == pytest.approx(math.exp(r["mean_nll"]), rel=1e-12)
        assert 1.0 < r["perplexity"] < 8192  # better than uniform over the vocabulary
    assert results["bf16"]["relative_diff_vs_bf16"] == 0.0
    printed = capsys.readouterr().out
    assert printed.startswith("Command: sits bench perplexity --max-tokens-per-file 64")
    assert printed.count("Command: ") == 1
    assert "| precision | tokens | mean NLL (nats) | perplexity | vs bf16 | target |" in printed
    assert "\n| bf16 | 128 | " in printed and "\n| int4 | 128 | " in printed
    assert f"  {doc['files'][0]['path']}: 64 of " in printed
