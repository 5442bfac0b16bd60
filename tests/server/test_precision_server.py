"""The precision switch's server half on a live server: /v1/admin/precision (auth, 400s, the
state JSON), the x-sits-precision header, the metrics, the audit fields and the overload
policy's wiring. The engine is a real tiny one with a simulated switch (`precision_fakes`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sits.admission import OverloadState
from sits.admission.precision_policy import PrecisionPolicyKind, PrecisionPolicySettings
from sits.obs import find_records, verify_log
from sits.obs.request_audit import AuditSettings
from sits.server.context import ServerSettings
from tests.server.live import LiveServer, metric_samples
from tests.server.precision_fakes import SwitchingEngine

ADMIN_KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
PATH = "/v1/admin/precision"
BODY = {"prompt": [11, 12, 13], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def switching(make_engine: Callable[[], Any]) -> Callable[[], SwitchingEngine]:
    return lambda: SwitchingEngine(make_engine())


def ctx_of(live: LiveServer) -> Any:
    return live.server.config.app.state.ctx


def switch(http, name: str) -> dict:
    response = http.post(PATH, json={"precision": name}, headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def live(tiny_moe_dir, engine_factory):
    settings = ServerSettings(admin_key=ADMIN_KEY)
    with LiveServer(switching(engine_factory(tiny_moe_dir)), settings) as server:
        yield server


def test_routes_404_without_an_admin_key(server) -> None:
    with server.http() as http:
        assert http.get(PATH, headers=AUTH).status_code == 404
        assert http.post(PATH, json={"precision": "int4"}, headers=AUTH).status_code == 404


def test_auth_state_json_and_400s(live) -> None:
    with live.http() as http:
        assert http.get(PATH).status_code == 401
        assert http.get(PATH, headers={"Authorization": "Bearer nope"}).status_code == 403
        assert http.post(PATH, json={"precision": "int4"}).status_code == 401
        start = http.get(PATH, headers=AUTH).json()
        policy = {"name": "manual", "red_seconds": 5.0, "green_seconds": 30.0}
        num = start["num_switches"]
        assert start == {
            "current": start["current"],
            "available": ["fp32", "int4"],
            "num_switches": num,
            "last_switch_step": start["last_switch_step"],
            "last_switch_unix_s": start["last_switch_unix_s"],
            "last_switch_delay_s": start["last_switch_delay_s"],
            "policy": policy,
        }
        switch(http, "fp32")
        state = switch(http, "int4")
        assert state["current"] == "int4" and state["policy"] == policy
        assert http.get(PATH, headers=AUTH).json() == state
        bad = http.post(PATH, json={"precision": "fp4"}, headers=AUTH)
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "precision" and error["type"] == "invalid_request_error"
        assert http.post(PATH, json={"precison": "int4"}, headers=AUTH).status_code == 400
        engine = live.engine
        engine.enabled = False
        try:
            off = http.post(PATH, json={"precision": "int4"}, headers=AUTH)
            assert off.status_code == 400
            assert "--precision-switch" in off.json()["error"]["message"]
            assert http.get(PATH, headers=AUTH).json() == {
                "current": None,
                "available": [],
                "num_switches": 0,
                "last_switch_step": None,
                "last_switch_unix_s": None,
                "last_switch_delay_s": None,
                "policy": policy,
            }
            assert "sits:weight_precision" not in http.get("/metrics").text
            plain = http.post("/v1/completions", json=BODY)
            assert plain.status_code == 200 and "x-sits-precision" not in plain.headers
        finally:
            engine.enabled = True
        switch(http, "fp32")


def test_metrics_exact(live) -> None:
    with live.http() as http:
        switch(http, "fp32")
        before = live.engine.state.num_switches
        switch(http, "int4")
        switch(http, "int4")  # already current: no switch
        samples = metric_samples(http.get("/metrics").text)
        assert samples[("sits:weight_precision", (("precision", "int4"),))] == 1.0
        assert samples[("sits:weight_precision", (("precision", "fp32"),))] == 0.0
        assert samples[("sits:precision_switches_total", ())] == before + 1
        switch(http, "fp32")
        samples = metric_samples(http.get("/metrics").text)
        assert samples[("sits:weight_precision", (("precision", "int4"),))] == 0.0
        assert samples[("sits:weight_precision", (("precision", "fp32"),))] == 1.0
        assert samples[("sits:precision_switches_total", ())] == before + 2
        data = http.get("/dashboard/data", headers=AUTH).json()
        assert data["precision"] == {
            "current": "fp32",
            "available": ["fp32", "int4"],
            "num_switches": before + 2,
        }


def test_header_on_completions_and_chat(live) -> None:
    with live.http() as http:
        for name in ("int4", "fp32"):
            switch(http, name)
            cmpl = http.post("/v1/completions", json=BODY)
            assert cmpl.status_code == 200 and cmpl.headers["x-sits-precision"] == name
            chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            chat = http.post("/v1/chat/completions", json=chat_body)
            assert chat.status_code == 200 and chat.headers["x-sits-precision"] == name
            streamed = {**chat_body, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=streamed) as r:
                assert r.status_code == 200 and r.headers["x-sits-precision"] == name
                assert "data: [DONE]" in list(r.iter_lines())
        refused = http.post("/v1/completions", json={**BODY, "max_tokens": -1})
        assert refused.status_code == 400 and "x-sits-precision" not in refused.headers


def _stream_switching(live: LiveServer, body: dict, to: str) -> tuple[str, str]:
    """Stream `body`, switch to `to` after the first chunk; (request id, header)."""
    with live.http() as http, http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        header = resp.headers["x-sits-precision"]
        first = next(line for line in lines if line.startswith("data: {"))
        switch(http, to)
        assert list(lines)[-2] == "data: [DONE]"
    return json.loads(first[6:])["id"], header


def test_audit_fields_and_header_across_a_switch(tmp_path, tiny_moe_dir, engine_factory) -> None:
    """A stream's header is the precision it started with, a whole answer's the one it ended
    with; each record holds the precision at its end and the switches while it ran."""
    log = tmp_path / "audit.jsonl"
    settings = ServerSettings(admin_key=ADMIN_KEY, audit=AuditSettings(path=str(log)))
    body = {**BODY, "max_tokens": 8}
    with LiveServer(switching(engine_factory(tiny_moe_dir)), settings) as live:
        with live.http() as http:
            plain = http.post("/v1/completions", json=body)
        live.engine.delay_s = 0.05  # 8 outputs over >= 0.4 s: time to switch between them
        streamed_id, streamed_header = _stream_switching(live, {**body, "stream": True}, "int4")
        whole: dict[str, Any] = {}

        def post_whole() -> None:
            with live.http() as http:
                response = http.post("/v1/completions", json=body)
            whole.update(response.json(), header=response.headers["x-sits-precision"])

        thread = threading.Thread(target=post_whole)
        thread.start()
        assert live.wait_until(lambda: live.engine.stats().num_running == 1)
        with live.http() as http:
            switch(http, "fp32")
        thread.join(30)
        live.engine.delay_s = 0.0
    assert plain.headers["x-sits-precision"] == "fp32"
    assert streamed_header == "fp32"
    assert whole["header"] == "fp32"  # started in int4, ended in float32
    assert verify_log(log).ok
    (rec,) = find_records(log, plain.json()["id"])
    assert (rec["precision"], rec["precision_switches"]) == ("fp32", 0)
    (rec,) = find_records(log, streamed_id)
    assert (rec["precision"], rec["precision_switches"]) == ("int4", 1)
    (rec,) = find_records(log, whole["id"])
    assert (rec["precision"], rec["precision_switches"]) == ("fp32", 1)


def test_overload_policy_switches_the_engine(tiny_moe_dir, engine_factory) -> None:
    policy = PrecisionPolicySettings(PrecisionPolicyKind.OVERLOAD, red_s=0.0, green_s=0.0)
    settings = ServerSettings(admin_key=ADMIN_KEY, precision_policy=policy)
    with LiveServer(switching(engine_factory(tiny_moe_dir)), settings) as live:
        qos = ctx_of(live).qos

        async def force(state: OverloadState | None) -> None:
            qos.force_overload_state(state)

        live.submit(force(OverloadState.RED)).result(5)
        assert live.wait_until(lambda: live.engine.state.current == "int4")
        live.submit(force(OverloadState.GREEN)).result(5)
        assert live.wait_until(lambda: live.engine.state.current == "fp32")
        with live.http() as http:
            state = http.get(PATH, headers=AUTH).json()
        assert state["num_switches"] == 2 and state["policy"]["name"] == "overload"
