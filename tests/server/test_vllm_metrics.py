"""vLLM's metrics of issue 29 on /metrics: iteration_tokens_total, request_params_n,
request_params_max_tokens, request_max_num_generation_tokens, cache_config_info, the
process_* and python_* collectors; no gauge named *_total and no *_created series."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sits.config import EngineConfig
from sits.obs.vllm_metrics import one_two_five_buckets
from tests.server.live import LiveServer, metric_samples


@pytest.fixture(scope="module")
def metrics_server(tiny_moe_dir):
    from sits.engine.async_llm import AsyncLLM

    config = EngineConfig(
        model=str(tiny_moe_dir),
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=4 << 20,
        enable_prefix_caching=False,
        swap_space=0.001,
    )
    with LiveServer(lambda: AsyncLLM(config)) as live:
        yield live


def _scrape(live) -> str:
    with live.http() as http:
        return http.get("/metrics").text


def test_one_two_five_buckets() -> None:
    assert one_two_five_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    assert one_two_five_buckets(1) == (1,)


def test_vllm_metrics_count_what_ran(metrics_server) -> None:
    client = metrics_server.client()
    model = client.models.list().data[0].id
    prompt = [11, 12, 13, 14, 15, 16, 17]
    client.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    samples = metric_samples(_scrape(metrics_server))
    # One prefill step of 7 tokens, then 4 decode steps of one token.
    assert samples[("sits:iteration_tokens_total_count", ())] == 5
    assert samples[("sits:iteration_tokens_total_sum", ())] == 7 + 4
    assert samples[("sits:iteration_tokens_total_bucket", (("le", "1.0"),))] == 4
    assert samples[("sits:iteration_tokens_total_bucket", (("le", "8.0"),))] == 5
    assert metrics_server.engine.stats().num_steps == 5
    client.completions.create(
        model=model, prompt="hello", n=2, max_tokens=3, extra_body={"ignore_eos": True}
    )
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    samples = metric_samples(_scrape(metrics_server))
    assert samples[("sits:request_params_n_count", ())] == 3
    assert samples[("sits:request_params_n_sum", ())] == 1 + 2 + 1
    assert samples[("sits:request_params_n_bucket", (("le", "1.0"),))] == 2
    assert samples[("sits:request_params_max_tokens_sum", ())] == 5 + 3 + 2
    assert samples[("sits:request_params_max_tokens_bucket", (("le", "2.0"),))] == 1
    assert samples[("sits:request_max_num_generation_tokens_sum", ())] == 5 + 3 + 2
    assert samples[("sits:request_max_num_generation_tokens_bucket", (("le", "5.0"),))] == 3


def test_cache_config_info(metrics_server) -> None:
    families = {f.name: f for f in text_string_to_metric_families(_scrape(metrics_server))}
    (sample,) = families["sits:cache_config_info"].samples
    stats = metrics_server.engine.stats()
    assert sample.value == 1.0
    assert {k: v for k, v in sample.labels.items() if k != "model_name"} == {
        "block_size": "16",
        "cache_dtype": "auto",
        "enable_prefix_caching": "False",
        "gpu_memory_utilization": "0.9",
        "num_gpu_blocks": str(stats.num_total_blocks),
        "num_cpu_blocks": str(stats.num_host_blocks_total),
        "swap_space": "0.001",
    }


def test_standard_collectors_and_exposition_rules(metrics_server) -> None:
    text = _scrape(metrics_server)
    families = list(text_string_to_metric_families(text))
    names = {f.name for f in families}
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "python_info",
                 "python_gc_collections"):  # fmt: skip
        assert name in names, name
    gauges_total = [f.name for f in families if f.type == "gauge" and f.name.endswith("_total")]
    assert gauges_total == []
    assert not [line for line in text.splitlines() if "_created" in line]
    assert "sits:prompt_tokens_total" in text  # counters keep their _total
