"""C16: /metrics matches reality (counts, token totals, TTFT against the client's clock)."""

from __future__ import annotations

import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server.live import LiveServer, metric_samples

NUM_REQUESTS = 20
NUM_PROMPT_TOKENS = 500
NUM_OUTPUT_TOKENS = 64
_JSON = {"Content-Type": "application/json"}


def _stream_one(base_url: str, index: int) -> tuple[float, dict]:
    """Send one streamed completion; return (client TTFT seconds, usage)."""
    prompt = [40 + (index * 7 + i) % 400 for i in range(NUM_PROMPT_TOKENS)]
    body = {
        "prompt": prompt,
        "max_tokens": NUM_OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage = None
    first_token_s = None
    with httpx.Client(base_url=base_url, timeout=120) as http:
        start = time.monotonic()
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk["choices"] and first_token_s is None:
                    first_token_s = time.monotonic() - start
                if chunk["usage"] is not None:
                    usage = chunk["usage"]
    assert first_token_s is not None and usage is not None
    return first_token_s, usage


def test_c16_metrics_match_reality(tiny_moe_dir, engine_factory) -> None:
    with LiveServer(engine_factory(tiny_moe_dir)) as live:
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            results = list(pool.map(lambda i: _stream_one(live.base_url, i), range(NUM_REQUESTS)))
        with live.http() as http:
            text = http.get("/metrics").text
    samples = metric_samples(text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    client_ttfts = [ttft for ttft, _ in results]
    usages = [usage for _, usage in results]
    assert all(u["prompt_tokens"] == NUM_PROMPT_TOKENS for u in usages)
    assert all(u["completion_tokens"] == NUM_OUTPUT_TOKENS for u in usages)
    # Token counters are exact.
    assert value("sits:prompt_tokens_total") == NUM_REQUESTS * NUM_PROMPT_TOKENS
    assert value("sits:generation_tokens_total") == NUM_REQUESTS * NUM_OUTPUT_TOKENS
    assert value("sits:request_success_total", finished_reason="length") == NUM_REQUESTS
    # One TTFT, queue time and E2E observation per request.
    ttft_count = value("sits:time_to_first_token_seconds_count")
    ttft_sum = value("sits:time_to_first_token_seconds_sum")
    assert ttft_count == NUM_REQUESTS
    assert value("sits:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert value("sits:request_queue_time_seconds_count") == NUM_REQUESTS
    # The server's TTFT lies inside the client's (arrival after the send, first token before
    # the client reads it), and is most of it.
    server_mean = ttft_sum / ttft_count
    client_mean = sum(client_ttfts) / len(client_ttfts)
    assert 0 < ttft_sum <= sum(client_ttfts)
    assert server_mean >= 0.5 * client_mean, (server_mean, client_mean)
    # Time per output token and inter-token latency are positive, one TPOT per request.
    assert value("sits:request_time_per_output_token_seconds_count") == NUM_REQUESTS
    assert value("sits:request_time_per_output_token_seconds_sum") > 0
    num_itl = value("sits:inter_token_latency_seconds_count")
    assert NUM_REQUESTS <= num_itl <= NUM_REQUESTS * (NUM_OUTPUT_TOKENS - 1)
    assert value("sits:inter_token_latency_seconds_sum") > 0
    # Nothing left running.
    assert value("sits:num_requests_running") == 0
    assert value("sits:num_requests_waiting") == 0
    assert value("sits:kv_cache_usage_perc") == 0


OUTCOME_OF_STATUS = {200: "ok", 400: "400", 404: "404"}


def _tenant_outcomes(live: LiveServer, tenant: str) -> dict[str, float]:
    with live.http() as http:
        samples = metric_samples(http.get("/metrics").text)
    return {
        dict(labels)["outcome"]: value
        for (name, labels), value in samples.items()
        if name == "sits:tenant_requests_total" and dict(labels)["tenant"] == tenant
    }


def test_c16_request_outcomes_match_what_clients_saw(server) -> None:
    """Every answer is counted once under the outcome of its status: an unknown model as 404,
    bodies refused before the handler (invalid JSON, a wrong type, not an object) as 400."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    requests = [
        ("/v1/completions", {"json": {"prompt": "a b", "max_tokens": 2}}),
        ("/v1/completions", {"json": {"prompt": "a b", "max_tokens": 2, "model": "nope"}}),
        ("/v1/chat/completions", {"json": {**chat, "model": "nope"}}),
        ("/v1/completions", {"content": b'{"model":', "headers": _JSON}),
        ("/v1/chat/completions", {"content": b'{"messages": [', "headers": _JSON}),
        ("/v1/completions", {"json": {"prompt": "a b", "temperature": "abc"}}),
        ("/v1/chat/completions", {"json": {**chat, "temperature": "abc"}}),
        ("/v1/completions", {"json": [1]}),
        ("/v1/completions", {"json": {"prompt": "a b", "max_tokens": -1}}),
        ("/v1/chat/completions", {"json": chat}),
    ]
    before = _tenant_outcomes(server, "default")
    with server.http() as http:
        statuses = [http.post(path, **kwargs).status_code for path, kwargs in requests]
    after = _tenant_outcomes(server, "default")
    assert statuses == [200, 404, 404, 400, 400, 400, 400, 400, 400, 200]
    seen = Counter(OUTCOME_OF_STATUS[status] for status in statuses)
    counted = {outcome: after[outcome] - before.get(outcome, 0.0) for outcome in after}
    assert counted == {outcome: float(seen[outcome]) for outcome in after}
    assert set(seen) <= set(after)
