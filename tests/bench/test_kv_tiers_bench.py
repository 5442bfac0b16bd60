"""sits.bench.kv_tiers runs on the CPU with a tiny checkpoint and its figures add up.

A 2x burst (8 requests of 12 + 8 tokens on a 5-block cache) preempts: recompute-only
recomputes, the host tier swaps instead; outputs are equal and the recomputed prefill tokens
drop to zero (the issue's target, >= 80 %).
"""

from __future__ import annotations

import json

from sits.bench import kv_tiers


def test_burst_recompute_versus_host_tier(tiny_model_factory, tmp_path, capsys) -> None:
    model_dir = tiny_model_factory("qwen2")
    cfg = json.loads((model_dir / "config.json").read_text())
    block_bytes = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"]
    result = tmp_path / "kv.json"
    argv = [
        "--model", str(model_dir), "--dtype", "float32", "--max-model-len", "128",
        "--kv-cache-memory-bytes", str(6 * block_bytes * 4),
        "--input-len", "12", "--output-len", "8", "--result-json", str(result),
    ]  # fmt: skip
    assert kv_tiers.main(argv) == 0
    report = capsys.readouterr().out
    assert "Burst: 8 requests of 12 + 8 tokens = 2.00x the device KV capacity (80 tokens)" in (
        report
    )
    assert "drop with the host tier: 100.0% (target >= 80%: met); greedy outputs equal: True" in (
        report
    )
    doc = json.loads(result.read_text())
    assert doc["outputs_equal"] and doc["target_met"] and doc["recomputed_drop"] == 1.0
    rec, host = doc["runs"]["recompute"], doc["runs"]["host"]
    for run in (rec, host):
        assert run["device_blocks"] == 5 and run["num_prompts"] == 8
        assert run["num_output_tokens"] == 8 * 8 and run["blocks_free_at_end"]
    assert rec["num_recompute_preemptions"] > 0 and rec["num_swap_preemptions"] == 0
    assert host["num_swap_preemptions"] > 0 and host["num_recompute_preemptions"] == 0
    assert host["num_swap_in_blocks"] == host["num_swap_out_blocks"] > 0
    # Exact accounting: the host run prefills each prompt once and never recomputes; the
    # recompute run computes exactly the recomputed positions more; a recompute victim's
    # dropped tokens are recomputed or hit its own still-cached blocks (random prompts share
    # nothing else).
    assert host["num_prefill_tokens"] == 8 * 12 and host["num_recomputed_prefill_tokens"] == 0
    assert rec["num_recomputed_prefill_tokens"] > 0
    num_extra = rec["num_scheduled_tokens"] - host["num_scheduled_tokens"]
    assert num_extra == rec["num_recomputed_prefill_tokens"]
    assert (
        rec["num_recomputed_tokens"]
        == rec["num_recomputed_prefill_tokens"] + rec["num_prefix_hit_tokens"]
    )
    assert host["host_blocks"] == 11  # room for the burst's 10 blocks (+1)
