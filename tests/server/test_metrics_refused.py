"""A request the engine refuses before running it (a 400: it needs more KV blocks than the
whole cache holds) is not counted as a finished request: `sits:request_success_total` counts
the requests that ran, as for the 400s the HTTP layer gives (found by a new-user trial)."""

from __future__ import annotations

from tests.server.live import LiveServer, metric_samples

# 40 blocks of 16 tokens for the tiny MoE (16 MiB hold 2,048): a 1,000-token request cannot fit.
SMALL_KV_BYTES = (16 << 20) * 40 // 2048


def test_request_larger_than_the_cache_is_a_400_not_an_abort(tiny_moe_dir, engine_factory):
    make_engine = engine_factory(tiny_moe_dir, kv_cache_memory_bytes=SMALL_KV_BYTES)
    with LiveServer(make_engine) as live, live.http() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        too_big = {"model": model, "prompt": "hello there", "max_tokens": 1000}
        refused = http.post("/v1/completions", json=too_big)
        ok = http.post("/v1/completions", json={**too_big, "max_tokens": 5})
        samples = metric_samples(http.get("/metrics").text)
    assert refused.status_code == 400
    assert "KV" in refused.json()["error"]["message"]
    assert ok.status_code == 200
    finished = {
        labels: value
        for (name, labels), value in samples.items()
        if name == "sits:request_success_total"
    }
    assert finished == {(("finished_reason", "length"),): 1.0}
