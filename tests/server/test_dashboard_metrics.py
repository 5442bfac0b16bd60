"""The dashboard's numbers are /metrics' numbers, on live servers after requests served and
refused (400, 429, 503), and while one request is held running on the engine:
- without --tenants, the one default tenant's running and waiting requests are the engine's
  totals (the plain-FCFS scheduler keeps no per-tenant numbers), its tier is none, and the
  engine's busy seconds are named after its device (GPU-seconds on a GPU only);
- with tenants, each tenant's running requests are the scheduler's, adding up to the total,
  and its refusals are its `sits:tenant_requests_total` outcomes;
- in headless Chromium the tenants table shows the same numbers (skipped without a browser,
  see tests/server/browser.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from sits.admission import OverloadState
from sits.config import EngineConfig
from sits.obs.tenant_metrics import OUTCOMES
from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import DEFAULT_TENANT_ID, TenantsConfig, Tier
from tests.server.browser import READ_TENANTS_JS, headless_chromium
from tests.server.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.server.live import LiveServer, metric_samples
from tests.server.tenant_fixtures import NEVER_OVERLOADED, auth, ctx_of, tenant
from tests.waits import HANG_S

TENANTS = TenantsConfig(
    (
        tenant("gold", tier=Tier.GUARANTEED, reserved_kv_fraction=0.5, ttft_ms=600_000),
        tenant("capped", requests_per_minute=1),
        tenant("free", ttft_ms=600_000),
    )
)
BODY = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "ignore_eos": True}
HELD_BODY = {"prompt": [11, 12, 13, 14], "max_tokens": 4, "ignore_eos": True}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class StepGate:
    """Holds the engine loop, once armed, at the start of the first step that finds a request
    running, until released; before holding it sends the last step's outputs and stats (what
    `while_gpu_runs` does first), so the front end's snapshot shows the request running.

    Attributes:
        armed: set to hold the next step that finds a running request.
        held: set while a step is held.
        release: set to let the held step go.
    """

    def __init__(self, core: Any) -> None:
        self._core = core
        self._step = core.step
        self.armed = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()
        core.step = self

    def __call__(self, while_gpu_runs: Callable[[], None] | None = None) -> Any:
        if self.armed.is_set() and self._core.scheduler.num_running > 0:
            self.armed.clear()
            if while_gpu_runs is not None:
                while_gpu_runs()
            self.held.set()
            self.release.wait(HANG_S)
        return self._step(while_gpu_runs)


def _post(live: LiveServer, tenant_id: str | None, **body: Any) -> httpx.Response:
    headers = auth(tenant_id) if tenant_id else {}
    with live.http() as http:
        return http.post("/v1/completions", json={**BODY, **body}, headers=headers)


def _data_and_metrics(live: LiveServer) -> tuple[dict[str, Any], Samples]:
    with live.http() as http:
        data = http.get("/dashboard/data").json()
        samples = metric_samples(http.get("/metrics").text)
    return data, samples


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@contextmanager
def _held(live: LiveServer, tenant_id: str | None) -> Iterator[None]:
    """While the body runs, one request of `tenant_id` runs on the held engine."""
    gate = StepGate(live.engine.engine_core)
    gate.armed.set()
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(_post(live, tenant_id, **HELD_BODY)))
    thread.start()
    try:
        assert gate.held.wait(HANG_S), "the engine never ran the request"
        assert live.wait_until(lambda: live.engine.stats().num_running == 1, HANG_S)
        yield
    finally:
        gate.release.set()
        thread.join(HANG_S)
    assert [a.status_code for a in answers] == [200]
    assert live.wait_until(lambda: live.engine.stats().num_running == 0, HANG_S)


def _assert_tenant_equals_metrics(row: dict[str, Any], samples: Samples, configured: bool) -> None:
    tid = row["id"]
    assert row["requests"] == {
        outcome: _value(samples, "sits:tenant_requests_total", tenant=tid, outcome=outcome)
        for outcome in OUTCOMES
    }
    for key, name in (
        ("prompt_tokens", "sits:tenant_prompt_tokens_total"),
        ("generation_tokens", "sits:tenant_generation_tokens_total"),
        ("in_flight", "sits:tenant_requests_in_flight"),
        ("gpu_s", "sits:tenant_gpu_seconds_total"),
    ):
        assert row[key] == _value(samples, name, tenant=tid), key
    if configured:
        load = {
            "num_running": _value(samples, "sits:tenant_num_requests_running", tenant=tid),
            "num_waiting": _value(samples, "sits:tenant_num_requests_waiting", tenant=tid),
            "kv_blocks_used": _value(samples, "sits:tenant_kv_blocks_used", tenant=tid),
        }
    else:  # plain FCFS: the one tenant owns the engine
        load = {
            "num_running": _value(samples, "sits:num_requests_running"),
            "num_waiting": _value(samples, "sits:num_requests_waiting"),
            "kv_blocks_used": _value(samples, "sits:kv_tier_blocks_used", tier="device"),
        }
    assert {key: row[key] for key in load} == load
    for slo in ("ttft", "tpot"):
        counted = _value(samples, "sits:tenant_slo_requests_total", tenant=tid, slo=slo)
        met = _value(samples, "sits:tenant_slo_met_total", tenant=tid, slo=slo)
        assert (row["slo"][slo]["num_requests"], row["slo"][slo]["num_met"]) == (counted, met)


def _assert_totals_equal_metrics(data: dict[str, Any], samples: Samples) -> None:
    totals, queue = data["totals"], data["queue"]
    assert totals["prompt_tokens"] == _value(samples, "sits:prompt_tokens_total")
    assert totals["generation_tokens"] == _value(samples, "sits:generation_tokens_total")
    assert totals["gpu_s"] == _value(samples, "sits:gpu_seconds_total")
    assert queue["num_running"] == _value(samples, "sits:num_requests_running")
    assert queue["num_waiting"] == _value(samples, "sits:num_requests_waiting")


@pytest.fixture(scope="module")
def default_server(tiny_moe_dir, engine_factory):
    """No --tenants: (live server, [(data, /metrics) held, (data, /metrics) at rest])."""
    # The held step must not pass the step timeout, however long the checks take.
    make_engine = engine_factory(tiny_moe_dir, step_timeout_s=2 * HANG_S)
    with LiveServer(make_engine) as live:
        assert _post(live, None).status_code == 200
        assert _post(live, None, max_tokens=-1).status_code == 400
        with _held(live, None):
            held = _data_and_metrics(live)
        yield live, [held, _data_and_metrics(live)]


def _tenant_engine(model_dir: Path) -> Callable[[], Any]:
    """`make_engine` for LiveServer: TENANTS scheduled, a step timeout the held step never
    reaches however long the checks take."""

    def make_engine() -> Any:
        from sits.engine.async_llm import AsyncLLM
        from sits.engine.builder import tenant_policies_of

        config = EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
        )
        policies = tenant_policies_of(TENANTS)
        return AsyncLLM(config, tenant_policies=policies, step_timeout_s=2 * HANG_S)

    return make_engine


@pytest.fixture(scope="module")
def tenant_server(tiny_moe_dir):
    """Tenants gold, capped, free after each kind of refusal: (live server, [(data, /metrics)
    while gold's request is held, (data, /metrics) at rest])."""
    settings = ServerSettings(tenants=TENANTS, qos=QosSettings(overload=NEVER_OVERLOADED))
    with LiveServer(_tenant_engine(tiny_moe_dir), settings) as live:
        assert _post(live, "gold").status_code == 200
        assert _post(live, "gold", max_tokens=-1).status_code == 400
        assert _post(live, "capped").status_code == 200
        assert _post(live, "capped").status_code == 429  # 1 request per minute
        qos = ctx_of(live).qos
        qos.force_overload_state(OverloadState.RED)  # red sheds best-effort tenants
        try:
            assert _post(live, "free").status_code == 503
        finally:
            qos.force_overload_state(None)
        assert _post(live, "free").status_code == 200
        with _held(live, "gold"):
            held = _data_and_metrics(live)
        yield live, [held, _data_and_metrics(live)]


def test_default_tenant_is_the_whole_engine(default_server) -> None:
    live, ((held, held_samples), (rest, rest_samples)) = default_server
    (row,) = held["tenants"]
    assert row["id"] == DEFAULT_TENANT_ID and row["tier"] is None
    assert held["device"] == live.engine.info.device.type  # "cpu" without a GPU
    assert held["queue"]["num_running"] == row["num_running"] == row["in_flight"] == 1
    assert row["kv_blocks_used"] >= 1
    assert row["requests"]["ok"] == 1 and row["requests"]["400"] == 1
    for data, samples in ((held, held_samples), (rest, rest_samples)):
        _assert_totals_equal_metrics(data, samples)
        _assert_tenant_equals_metrics(data["tenants"][0], samples, configured=False)
    (row,) = rest["tenants"]
    assert row["num_running"] == row["in_flight"] == 0 and row["requests"]["ok"] == 2


def test_tenants_running_and_refusals_equal_metrics(tenant_server) -> None:
    _, ((held, held_samples), (rest, rest_samples)) = tenant_server
    for data, samples in ((held, held_samples), (rest, rest_samples)):
        _assert_totals_equal_metrics(data, samples)
        for row in data["tenants"]:
            _assert_tenant_equals_metrics(row, samples, configured=True)
    rows = {row["id"]: row for row in held["tenants"]}
    assert [rows[t]["tier"] for t in rows] == ["guaranteed", "best_effort", "best_effort"]
    assert {t: r["num_running"] for t, r in rows.items()} == {"gold": 1, "capped": 0, "free": 0}
    assert sum(r["num_running"] for r in rows.values()) == held["queue"]["num_running"] == 1
    shown = ("ok", "400", "429", "503")
    refusals = {t: {o: r["requests"][o] for o in shown} for t, r in rows.items()}
    assert refusals == {
        "gold": {"ok": 1, "400": 1, "429": 0, "503": 0},
        "capped": {"ok": 1, "400": 0, "429": 1, "503": 0},
        "free": {"ok": 1, "400": 0, "429": 0, "503": 1},
    }
    assert {row["id"]: row["requests"]["ok"] for row in rest["tenants"]} == {
        "gold": 2,
        "capped": 1,
        "free": 1,
    }


_BUSY_LABELS = {"cpu": ["CPU busy seconds", "CPU busy s"], "cuda": ["GPU-seconds", "GPU-s"]}
_READ_BUSY_LABELS_JS = """
return ["busy-label", "busy-column"].map((id) => document.getElementById(id).textContent);
"""


def _page_tenants(browser: Any, base_url: str) -> dict[str, dict[str, str]]:
    """The tenants table once the page has rendered twice (so it shows a full poll)."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{base_url}/dashboard?poll_ms=200")
    polls = "return Number(document.body.dataset.polls || 0);"
    WebDriverWait(browser, HANG_S).until(lambda d: d.execute_script(polls) >= 2)
    return dict(browser.execute_script(READ_TENANTS_JS))


def test_page_tenants_table_shows_the_metrics(default_server, tenant_server) -> None:
    with headless_chromium() as browser:
        for live, configured in ((default_server[0], False), (tenant_server[0], True)):
            page = _page_tenants(browser, live.base_url)
            _, samples = _data_and_metrics(live)
            ids = TENANTS.ids if configured else (DEFAULT_TENANT_ID,)
            assert list(page) == list(ids)
            for tid in ids:
                cells = page[tid]
                for outcome in ("ok", "400", "429", "503"):
                    name = "sits:tenant_requests_total"
                    count = _value(samples, name, tenant=tid, outcome=outcome)
                    assert cells[f"requests_{outcome}"] == f"{count:,.0f}", (tid, outcome)
                assert cells["requests_other"] == "0"
                assert cells["num_running"] == "0"
                tokens = _value(samples, "sits:tenant_prompt_tokens_total", tenant=tid)
                assert cells["prompt_tokens"] == f"{tokens:,.0f}"
            if not configured:
                assert page[DEFAULT_TENANT_ID]["tier"] == "none (FCFS)"
            else:
                assert page["gold"]["tier"] == "guaranteed"
            expected = _BUSY_LABELS[live.engine.info.device.type]
            assert browser.execute_script(_READ_BUSY_LABELS_JS) == expected
            errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
            assert errors == []
