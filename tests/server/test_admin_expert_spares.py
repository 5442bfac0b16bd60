"""The operator's restore into a spare expert slot (`--num-spare-experts`) on a live server:
the routing table moves the expert to the spare, the JSON and the metrics show the spare slots
and the restore counters, and the outputs stay those of the checkpoint."""

from __future__ import annotations

import pytest

from sits.server.context import ServerSettings
from tests.server.live import LiveServer, metric_samples

ADMIN_KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
LAYER = 1
NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def spare_server(tiny_moe_dir, engine_factory):
    settings = ServerSettings(admin_key=ADMIN_KEY)
    with LiveServer(engine_factory(tiny_moe_dir, num_spare_experts=2), settings) as live:
        yield live


def completion(http, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = http.post("/v1/completions", json={**body, "logprobs": 1})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def spare_samples(http) -> dict:
    samples = metric_samples(http.get("/metrics").text)
    return {
        key: value
        for key, value in samples.items()
        if key[0].startswith(("sits:moe_spare_slots", "sits:moe_expert_spare_restores"))
        or key[0].startswith("sits:moe_expert_restores")
    }


def test_operator_restore_uses_a_spare_slot(spare_server) -> None:
    with spare_server.http() as http:
        original = completion(http, [70, 71, 72])
        body = http.get("/v1/admin/experts", headers=AUTH).json()
        assert body["num_spare_experts"] == 2 and body["num_spare_restores"] == 0
        layer = body["layers"][LAYER]
        assert layer["expert_slots"] == list(range(NUM_EXPERTS))
        assert (layer["num_free_slots"], layer["num_relocated"]) == (2, 0)
        bad = max(range(NUM_EXPERTS), key=lambda e: layer["num_tokens"][e])

        assert http.post(f"/v1/admin/experts/{LAYER}/{bad}/freeze", headers=AUTH).status_code == 200
        restored = http.post(f"/v1/admin/experts/{LAYER}/{bad}/restore", headers=AUTH)
        assert restored.status_code == 200
        body = restored.json()
        assert body["num_restores"] == body["num_spare_restores"] == 1
        assert body["num_auto_freezes"] == 0
        layer = body["layers"][LAYER]
        assert layer["frozen"] == [False] * NUM_EXPERTS
        assert layer["expert_slots"] == [NUM_EXPERTS if e == bad else e for e in range(8)]
        assert (layer["num_free_slots"], layer["num_relocated"]) == (2, 1)
        assert body["layers"][0]["expert_slots"] == list(range(NUM_EXPERTS))

        assert spare_samples(http) == {
            ("sits:moe_expert_restores_total", ()): 1.0,
            ("sits:moe_expert_spare_restores_total", ()): 1.0,
            ("sits:moe_spare_slots", (("layer", "0"), ("state", "free"))): 2.0,
            ("sits:moe_spare_slots", (("layer", "0"), ("state", "used"))): 0.0,
            ("sits:moe_spare_slots", (("layer", "1"), ("state", "free"))): 2.0,
            ("sits:moe_spare_slots", (("layer", "1"), ("state", "used"))): 1.0,
        }
        again = completion(http, [70, 71, 72])
        assert again["text"] == original["text"] and again["logprobs"] == original["logprobs"]
        after = http.get("/v1/admin/experts", headers=AUTH).json()["layers"][LAYER]
        assert after["num_tokens"][bad] > layer["num_tokens"][bad]  # routed to the spare
