"""/v1/admin/experts and the MoE expert metrics on a live server: admin-key auth, a NaN expert
injected while a request streams is frozen after three anomalous checks, the stream finishes,
later outputs are finite, and operators can freeze and unfreeze experts."""

from __future__ import annotations

import json
import math
import threading

import pytest

from sits.server.context import ServerSettings
from tests.server.live import LiveServer, metric_samples

ADMIN_KEY = "admin-secret"
LAYER = 1
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def admin_server(tiny_moe_dir, engine_factory):
    settings = ServerSettings(admin_key=ADMIN_KEY)
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live:
        yield live


def completion(http, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json={**body, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_admin_routes_404_without_a_configured_key(server) -> None:
    with server.http() as http:
        assert http.get("/v1/admin/experts", headers=AUTH).status_code == 404
        assert http.post("/v1/admin/experts/0/0/freeze", headers=AUTH).status_code == 404


def test_admin_auth_and_operator_freeze(admin_server) -> None:
    with admin_server.http() as http:
        assert http.get("/v1/admin/experts").status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.get("/v1/admin/experts", headers=wrong).status_code == 403
        assert http.post("/v1/admin/experts/0/3/freeze").status_code == 401
        assert http.post("/v1/admin/experts/0/3/unfreeze", headers=wrong).status_code == 403
        completion(http, [11, 12, 13], 4)
        body = http.get("/v1/admin/experts", headers=AUTH).json()
        assert [layer["layer"] for layer in body["layers"]] == [0, 1]
        assert body["num_experts"] == 8 and body["freeze_after"] == 3
        layer0 = body["layers"][0]
        assert sum(layer0["num_tokens"]) >= (3 + 3) * 2
        counts = layer0["num_tokens"]
        assert layer0["imbalance"] == pytest.approx(max(counts) * 8 / sum(counts))
        frozen = http.post("/v1/admin/experts/0/3/freeze", headers=AUTH)
        assert frozen.status_code == 200
        assert frozen.json()["layers"][0]["frozen"] == [e == 3 for e in range(8)]
        samples = metric_samples(http.get("/metrics").text)
        assert samples[("sits:moe_expert_frozen", (("expert", "3"), ("layer", "0")))] == 1.0
        assert samples[("sits:moe_expert_auto_freezes_total", ())] == 0.0
        assert http.post("/v1/admin/experts/7/0/freeze", headers=AUTH).status_code == 400
        assert http.post("/v1/admin/experts/0/8/freeze", headers=AUTH).status_code == 400
        unfrozen = http.post("/v1/admin/experts/0/3/unfreeze", headers=AUTH)
        assert unfrozen.json()["layers"][0]["frozen"] == [False] * 8
        samples = metric_samples(http.get("/metrics").text)
        assert samples[("sits:moe_expert_frozen", (("expert", "3"), ("layer", "0")))] == 0.0


def test_nan_expert_frozen_while_requests_run(admin_server) -> None:
    with admin_server.http() as http:
        completion(http, [21, 22, 23, 24], 8)
        original = completion(http, [70, 71, 72], 6, logprobs=1)["choices"][0]
        before = http.get("/v1/admin/experts", headers=AUTH).json()["layers"][LAYER]
        bad = max(range(8), key=lambda e: before["num_tokens"][e])
        assert not any(before["frozen"])

        streamed: list[dict] = []

        def stream_long() -> None:
            body = {
                "prompt": [5, 6, 7],
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with (
                admin_server.http() as other,
                other.stream("POST", "/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(json.loads(line[len("data: ") :]))

        runner = threading.Thread(target=stream_long)
        runner.start()
        assert admin_server.wait_until(lambda: len(streamed) >= 2)
        block = admin_server.engine.engine_core.runner.model.model.layers[LAYER].mlp
        block.w2.data[bad] = float("nan")  # fault injection while the stream runs
        layer: dict = {}
        for attempt in range(20):
            completion(http, [30 + attempt, 40 + attempt], 4)
            layer = http.get("/v1/admin/experts", headers=AUTH).json()["layers"][LAYER]
            if layer["frozen"][bad]:
                break
        assert layer["frozen"] == [e == bad for e in range(8)]
        assert layer["num_anomalous"][bad] == 3  # frozen by the third anomalous check
        assert sum(layer["num_anomalous"]) == 3
        runner.join(60)
        assert not runner.is_alive()
        # The request in flight went on through the fault and the freeze to its last token.
        assert streamed[-1]["usage"]["completion_tokens"] == 48
        assert streamed[-2]["choices"][0]["finish_reason"] == "length"

        frozen_tokens = layer["num_tokens"][bad]
        for prompt in ([51, 52], [61, 62, 63], [5, 6, 7]):
            out = completion(http, prompt, 6, logprobs=1)
            logprobs = out["choices"][0]["logprobs"]["token_logprobs"]
            assert len(logprobs) == 6 and all(math.isfinite(lp) for lp in logprobs)
        after = http.get("/v1/admin/experts", headers=AUTH).json()
        assert after["layers"][LAYER]["num_tokens"][bad] == frozen_tokens
        assert after["num_auto_freezes"] == 1
        samples = metric_samples(http.get("/metrics").text)
        cell = (("expert", str(bad)), ("layer", str(LAYER)))
        assert samples[("sits:moe_expert_frozen", cell)] == 1.0
        assert samples[("sits:moe_expert_anomalous_checks_total", cell)] == 3.0
        assert samples[("sits:moe_expert_auto_freezes_total", ())] == 1.0
        tokens = after["layers"][0]["num_tokens"]
        for expert, count in enumerate(tokens):
            key = ("sits:moe_expert_tokens_total", (("expert", str(expert)), ("layer", "0")))
            assert samples[key] == count
        assert ("sits:moe_expert_imbalance", (("layer", "1"),)) in samples

        wrong = {"Authorization": "Bearer nope"}
        assert http.post(f"/v1/admin/experts/1/{bad}/restore", headers=wrong).status_code == 403
        restored = http.post(f"/v1/admin/experts/1/{bad}/restore", headers=AUTH).json()
        assert restored["num_restores"] == 1
        assert restored["layers"][LAYER]["frozen"] == [False] * 8
        again = completion(http, [70, 71, 72], 6, logprobs=1)["choices"][0]
        assert again["text"] == original["text"]
        assert again["logprobs"] == original["logprobs"]
