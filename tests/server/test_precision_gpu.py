"""The precision switch under load on a GPU: a live server on a tiny MoE engine in bfloat16
with CUDA graphs and `precision_switch` fp8 or int4; streamed requests run while the operator
switches 20 times. Every request succeeds, and each switch reaches its first step in the new
set within `MAX_SWITCH_DELAY_S` (`PrecisionState.last_switch_delay_s`)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from sits.server.context import ServerSettings
from tests.server.live import LiveServer

pytestmark = pytest.mark.gpu

ADMIN_KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
NUM_CLIENTS = 8
NUM_SWITCHES = 20
MAX_SWITCH_DELAY_S = 0.5  # a tiny model's steps take milliseconds; the target is < 1 step


def _stream(live: LiveServer, index: int, failures: list[str], stop: threading.Event) -> None:
    with live.http() as http:
        while not stop.is_set():
            body = {"prompt": [5 + index, 6, 7], "max_tokens": 64, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                text = resp.read().decode()
            chunks = [json.loads(x[6:]) for x in text.splitlines() if x.startswith("data: {")]
            if resp.status_code != 200 or any("error" in c for c in chunks):
                failures.append(text[-300:])


def _wait_for_first_step(http, num_switches: int) -> dict:
    """The state once switch `num_switches` has run its first step (its delay is known)."""
    deadline = time.monotonic() + 10
    while True:
        state = http.get("/v1/admin/precision", headers=AUTH).json()
        if state["num_switches"] == num_switches and state["last_switch_delay_s"] is not None:
            return state
        assert time.monotonic() < deadline, state
        time.sleep(0.005)


@pytest.mark.parametrize("scheme", ["fp8", "int4"])
def test_switches_under_load(scheme, tiny_model_factory, engine_factory) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = tiny_model_factory("qwen3_moe", hidden_size=128, moe_intermediate_size=128, head_dim=32)
    make_engine = engine_factory(model, device="cuda", dtype="bfloat16", precision_switch=scheme)
    failures: list[str] = []
    delays_s: list[float] = []
    stop = threading.Event()
    with LiveServer(make_engine, ServerSettings(admin_key=ADMIN_KEY)) as live, live.http() as http:
        clients = [
            threading.Thread(target=_stream, args=(live, i, failures, stop))
            for i in range(NUM_CLIENTS)
        ]
        for client in clients:
            client.start()
        time.sleep(1.0)  # the clients' requests are running
        for n in range(NUM_SWITCHES):
            name = scheme if n % 2 == 0 else "bf16"
            response = http.post("/v1/admin/precision", json={"precision": name}, headers=AUTH)
            assert response.status_code == 200, response.text
            state = _wait_for_first_step(http, n + 1)
            assert state["current"] == name
            delays_s.append(state["last_switch_delay_s"])
            time.sleep(0.1)
        stop.set()
        for client in clients:
            client.join(120)
    print(f"{scheme}: switch delays (ms):", [round(1000 * d, 2) for d in delays_s])
    assert failures == []
    assert max(delays_s) < MAX_SWITCH_DELAY_S, delays_s
