"""bench/prefix_ttft.py on a tiny random-weights shape: both runs complete and the cached run
hits exactly the shared prefix's full blocks for every request after the first."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "prefix_ttft.py"


def test_prefix_ttft_counts_hits(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    spec = importlib.util.spec_from_file_location("prefix_ttft", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "r.json"
    rc = module.main(
        ["--random-weights", "tiny-qwen3-moe", "--dtype", "float32", "--prefix-len", "64",
         "--suffix-len", "4", "--num-requests", "3", "--result-json", str(out)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    # Request 1 fills the cache; requests 2 and 3 each hit the prefix's 4 full blocks (64 tokens).
    assert doc["prefix_cache"]["num_hit_tokens"] == 2 * 64
    assert set(doc["rows"]) == {"cold", "cached"}
    assert "cached / cold mean TTFT" in capsys.readouterr().out
