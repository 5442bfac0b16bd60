"""sits.bench.prefix_ttft on a tiny random-weights shape (block_size 16): both engines complete
each arrival pattern, and the caching-on engine's prefix-cache hits and the engine step counts
are exactly what the scheduler's rules give.

Sequential: the first request fills the cache, every later one hits the prefix's full blocks.
Burst: blocks enter the cache after the step that computed them, so the k requests admitted in
the first step miss (k = ceil(budget / prompt tokens), the last one possibly as a chunk that
goes on without a second lookup) and every later one hits the prefix's full blocks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sits.bench import prefix_ttft

BLOCK_SIZE = 16  # EngineConfig's default


def _main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> dict:
    monkeypatch.setenv("SITS_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    common = ["--random-weights", "tiny-qwen3-moe", "--dtype", "float32", "--result-json"]
    assert prefix_ttft.main([*common, str(out), *args]) == 0
    return json.loads(out.read_text())


def test_prefix_ttft_counts_hits(tmp_path, monkeypatch, capsys) -> None:
    doc = _main(
        tmp_path, monkeypatch,
        "--prefix-len", "64", "--suffix-len", "4", "--num-requests", "3", "--arrival", "sequential",
    )  # fmt: skip
    # Request 1 fills the cache; requests 2 and 3 each hit the prefix's 4 full blocks (64 tokens).
    assert doc["prefix_cache"] == {"num_requests": 3, "num_query_tokens": 3 * 68,
                                   "num_hit_tokens": 2 * 64}  # fmt: skip
    assert set(doc["rows"]) == {"cold", "cached"}
    assert doc["rows"]["cached"]["num_steps"] == 3  # one step per request
    assert doc["arrival"] == ["sequential"] and "burst" not in doc
    out = capsys.readouterr().out
    assert "sequential: cached / cold mean TTFT" in out and "Arrival burst" not in out


@pytest.mark.parametrize(
    ("budget_tokens", "cold_steps", "cached_steps"),
    [
        # 8 x 210 = 1680 prompt tokens fit in one step: all 8 admitted before any block is
        # cached, so the burst hits nothing.
        (2048, 1, 1),
        # Step 1: request 0 (210 tokens) and a 46-token chunk of request 1 (k = 2). Cold:
        # 1680 tokens at 256 a step = 7 steps. Cached, step 2: request 1's 164 tokens, then
        # requests 2..7 hit 192 tokens and need 18 each (2 for request 7, whose last 16 run
        # in step 3): 3 steps.
        (256, 7, 3),
    ],
)
def test_prefix_ttft_burst_hits_after_first_step(
    tmp_path, monkeypatch, capsys, budget_tokens, cold_steps, cached_steps
) -> None:
    num_requests, prefix_len, suffix_len = 8, 200, 10
    doc = _main(
        tmp_path, monkeypatch,
        "--prefix-len", str(prefix_len), "--suffix-len", str(suffix_len),
        "--num-requests", str(num_requests), "--max-num-batched-tokens", str(budget_tokens),
    )  # fmt: skip
    prompt_tokens = prefix_len + suffix_len
    prefix_block_tokens = prefix_len // BLOCK_SIZE * BLOCK_SIZE  # 192: block 12 holds suffix
    num_first_step = min(num_requests, math.ceil(budget_tokens / prompt_tokens))
    assert doc["arrival"] == ["sequential", "burst"]
    burst = doc["burst"]
    assert burst["prefix_cache"] == {
        "num_requests": num_requests,
        "num_query_tokens": num_requests * prompt_tokens,
        "num_hit_tokens": (num_requests - num_first_step) * prefix_block_tokens,
    }
    assert burst["rows"]["cold"]["num_steps"] == cold_steps
    assert burst["rows"]["cached"]["num_steps"] == cached_steps
    assert set(burst["rows"]["cold"]) == {"mean_ms", "p50_ms", "p99_ms", "num_steps"}
    assert burst["ratio"] == pytest.approx(
        burst["rows"]["cached"]["mean_ms"] / burst["rows"]["cold"]["mean_ms"]
    )
    assert burst["target_met"] == (burst["ratio"] <= 0.20)
    # Sequential still works, and its results stay at the top level too.
    sequential = doc["sequential"]
    assert sequential["prefix_cache"]["num_hit_tokens"] == (num_requests - 1) * prefix_block_tokens
    assert sequential["rows"]["cached"]["num_steps"] == num_requests
    assert {k: doc[k] for k in ("rows", "ratio", "prefix_cache")} == {
        k: sequential[k] for k in ("rows", "ratio", "prefix_cache")
    }
    out = capsys.readouterr().out
    hits = burst["prefix_cache"]["num_hit_tokens"]
    assert f"burst: prefix cache (caching on): {hits} hit tokens of 1680 prompt tokens" in out
    assert "| burst | on |" in out and "| sequential | off |" in out
