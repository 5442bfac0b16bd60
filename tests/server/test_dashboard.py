"""GET /dashboard and /dashboard/data on a live multi-tenant MoE server after a known run: the
data equals what the clients saw (tokens, requests, per-tenant SLOs and cost, request
timelines with their prefill chunks, latency percentiles, expert load), the page references
only endpoints the server has and nothing outside it, and in headless Chromium it loads with
no console error and shows the run's numbers.

The browser test is skipped without a headless browser (tests/server/browser.py says what it
needs).
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import TenantsConfig
from tests.server.browser import headless_chromium
from tests.server.live import LiveServer
from tests.server.tenant_fixtures import NEVER_OVERLOADED, auth, tenant, tenant_engine
from tests.waits import HANG_S

PRICE_PER_HOUR = 1.5
ADMIN_KEY = "sk-admin-dashboard"  # with tenants, recent requests are shown to the admin only
BUDGET_TOKENS = 32
TENANTS = TenantsConfig(
    (tenant("gold", ttft_ms=600_000), tenant("free", ttft_ms=0.001), tenant("idle"))
)
# (tenant, prompt length, max_tokens, n): distinct prompts, no prefix-cache hits between them.
RUN = (
    ("gold", 70, 6, 1),
    ("gold", 33, 9, 1),
    ("gold", 45, 4, 2),
    ("free", 12, 7, 1),
    ("free", 90, 5, 1),
)
NUM_SAMPLES = sum(n for *_, n in RUN)
REFUSED_BODY = {"prompt": [3, 4, 5], "max_tokens": -1}  # free's one refusal (400)


_ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _complete(base_url: str, index: int) -> dict[str, Any]:
    tenant_id, prompt_len, max_tokens, n = RUN[index]
    prompt = [3 + index + (i * 29) % 350 for i in range(prompt_len)]
    body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=HANG_S) as http:
        response = http.post("/v1/completions", json=body, headers=auth(tenant_id))
    assert response.status_code == 200, response.text
    return {"tenant": tenant_id, "prompt_len": prompt_len, "n": n, **response.json()}


@pytest.fixture(scope="module")
def run(tiny_moe_dir):
    """(live server, client responses, /dashboard/data after the run)."""
    settings = ServerSettings(
        tenants=TENANTS,
        qos=QosSettings(overload=NEVER_OVERLOADED),  # free's SLO alone would turn it red
        gpu_price_per_hour=PRICE_PER_HOUR,
        admin_key=ADMIN_KEY,
    )
    engine = tenant_engine(tiny_moe_dir, TENANTS, max_num_batched_tokens=BUDGET_TOKENS)
    with LiveServer(engine, settings) as live:
        with ThreadPoolExecutor(len(RUN)) as pool:
            responses = list(pool.map(lambda i: _complete(live.base_url, i), range(len(RUN))))
        assert live.wait_until(lambda: live.engine.stats().num_running == 0, HANG_S)
        with live.http() as http:
            refused = http.post("/v1/completions", json=REFUSED_BODY, headers=auth("free"))
            assert refused.status_code == 400, refused.text
            data = http.get("/dashboard/data", headers=_ADMIN).json()
        yield live, responses, data


def test_data_totals_tenants_and_cost_equal_the_run(run) -> None:
    live, responses, data = run
    usages = [r["usage"] for r in responses]
    totals = data["totals"]
    assert totals["requests"] == {"length": NUM_SAMPLES}
    assert totals["prompt_tokens"] == sum(u["prompt_tokens"] for u in usages)
    assert totals["generation_tokens"] == sum(u["completion_tokens"] for u in usages)
    assert data["queue"]["num_running"] == 0 and data["queue"]["num_waiting"] == 0
    assert data["overload"]["state"] == "green" and data["overload"]["breaker"] == "closed"
    assert data["healthy"] is True
    stats = live.engine.stats()
    assert {"tier": "device", "used_blocks": 0, "total_blocks": stats.num_total_blocks} in data[
        "kv"
    ]
    tenants = {t["id"]: t for t in data["tenants"]}
    assert list(tenants) == ["gold", "free", "idle"]
    for tenant_id in ("gold", "free"):
        mine = [r["usage"] for r in responses if r["tenant"] == tenant_id]
        row = tenants[tenant_id]
        assert row["prompt_tokens"] == sum(u["prompt_tokens"] for u in mine)
        assert row["generation_tokens"] == sum(u["completion_tokens"] for u in mine)
        assert row["requests"]["ok"] == len(mine)
        assert row["requests"]["400"] == (1 if tenant_id == "free" else 0)
        assert row["gpu_s"] > 0
        assert row["cost"] == pytest.approx(row["gpu_s"] / 3600 * PRICE_PER_HOUR, rel=1e-9)
        num_tokens = row["prompt_tokens"] + row["generation_tokens"]
        expected = row["cost"] / num_tokens * 1e6
        assert row["cost_per_million_tokens"] == pytest.approx(expected, rel=1e-9)
    assert tenants["gold"]["slo"]["ttft"] == {
        "target_ms": 600_000,
        "num_requests": 3,
        "num_met": 3,
        "attainment": 1.0,
    }
    assert tenants["free"]["slo"]["ttft"]["attainment"] == 0.0
    assert tenants["gold"]["slo"]["tpot"]["target_ms"] is None
    assert tenants["idle"]["gpu_s"] == 0 and tenants["idle"]["cost_per_million_tokens"] is None
    assert data["gpu_price_per_hour"] == PRICE_PER_HOUR
    assert data["experts"] == stats.experts.to_json()
    assert [layer["layer"] for layer in data["experts"]["layers"]] == [0, 1]


def test_data_request_timelines_and_percentiles(run) -> None:
    _, responses, data = run
    by_id = {r["id"]: r for r in responses}
    timelines = data["requests"]
    assert {t["request_id"] for t in timelines} == set(by_id)
    for t in timelines:
        response = by_id[t["request_id"]]
        assert t["tenant"] == response["tenant"] and t["num_samples"] == response["n"]
        assert t["num_prompt_tokens"] == response["usage"]["prompt_tokens"]
        assert t["num_output_tokens"] == response["usage"]["completion_tokens"]
        assert t["finish_reason"] == "length"
        assert 0 <= t["queue_end_s"] <= t["first_token_s"] <= t["finished_s"] <= t["age_s"]
        chunks = t["prefill_chunks"]
        assert chunks and all(c["num_tokens"] <= BUDGET_TOKENS for c in chunks)
        # The first chunk ran in the step that first scheduled the request.
        assert chunks[0]["start_s"] == t["queue_end_s"]
        if response["n"] == 1:
            assert chunks[0]["start_position"] == 0  # no prefix-cache hit
            assert sum(c["num_tokens"] for c in chunks) == response["prompt_len"]
            for before, after in zip(chunks, chunks[1:]):
                assert after["start_position"] == before["start_position"] + before["num_tokens"]
            assert chunks[-1]["end_s"] <= t["first_token_s"]
        else:  # both samples computed prompt tokens (the second may reuse the first's blocks)
            assert sum(c["num_tokens"] for c in chunks) > response["prompt_len"]
    longest = next(t for t in timelines if t["num_prompt_tokens"] == 90)
    assert len(longest["prefill_chunks"]) >= math.ceil(90 / BUDGET_TOKENS)
    latency = data["latency"]
    assert latency["num_requests"] == len(RUN)
    ttfts = sorted(t["first_token_s"] for t in timelines)
    assert latency["ttft_s"]["p50"] == ttfts[2]  # nearest rank: ceil(0.5 * 5) = 3rd
    assert latency["ttft_s"]["p99"] == ttfts[-1]
    e2es = sorted(t["finished_s"] for t in timelines)
    assert latency["e2e_s"]["p90"] == e2es[-1]
    assert latency["queue_s"]["p50"] == sorted(t["queue_end_s"] for t in timelines)[2]
    assert 0 < latency["tpot_s"]["p50"] <= latency["tpot_s"]["p99"]


def test_page_references_only_existing_endpoints(run) -> None:
    live, _, _ = run
    with live.http() as http:
        page = http.get("/dashboard")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        html = page.text
        constants = dict(re.findall(r'const ([A-Z_]+) = "([^"]*)";', html))
        fetched = re.findall(r"fetch\(\s*([A-Z_]+|\"[^\"]+\")", html)
        urls = [constants[f] if f in constants else f.strip('"') for f in fetched]
        urls += re.findall(r'(?:src|href|action)="([^"]*)"', html)
        local = [u for u in urls if not u.startswith("data:")]
        assert local == ["/dashboard/data"]
        for url in local:
            assert http.get(url, headers=_ADMIN).status_code == 200, url
    # Nothing is loaded from outside the server (the SVG namespace is a name, not a fetch).
    assert set(re.findall(r"https?://[^\s\"')]+", html)) <= {"http://www.w3.org/2000/svg"}
    assert "<script src" not in html and '<link rel="stylesheet"' not in html


@pytest.fixture
def browser():
    """A headless Chromium (skips the test without one)."""
    with headless_chromium() as driver:
        yield driver


# Reads the page in one script run: the page re-renders on every poll, so element handles kept
# across calls would go stale.
_READ_PAGE_JS = """
const q = (sel) => Array.from(document.querySelectorAll(sel));
const text = (id) => document.getElementById(id).textContent;
return {
  polls: Number(document.body.dataset.polls || 0),
  totalRequests: text("total-requests"),
  promptTokens: text("prompt-tokens"),
  generationTokens: text("generation-tokens"),
  overload: text("overload-state"),
  breaker: text("breaker-state"),
  tenants: q("#tenants tbody tr").map((r) => [r.dataset.tenant,
    Object.fromEntries(Array.from(r.cells).map((c) => [c.dataset.key, c.textContent]))]),
  latency: q("#latency tbody tr").map((r) => [r.dataset.metric, r.cells[1].dataset.value]),
  expertCells: q("#experts rect.cell").map((c) => Number(c.dataset.value)),
  frozen: q("#experts path.frozen").length,
  requests: q("#timeline g.req").length,
  prefillBars: q("#timeline rect.prefill").length,
  decodeBars: q("#timeline rect.decode").length,
};
"""


def test_dashboard_in_headless_chromium_shows_the_run(run, browser) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    live, responses, data = run
    from selenium.webdriver.common.by import By

    browser.get(f"{live.base_url}/dashboard?poll_ms=200")
    # The first poll gets 401 and shows the key form; the page keeps the key for its polls.
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "admin-key").is_displayed())
    browser.find_element(By.ID, "admin-key").send_keys(ADMIN_KEY)
    browser.find_element(By.ID, "admin-key").submit()
    # Polls run one after another: once one rendered, every later one carries the key.
    WebDriverWait(browser, 60).until(lambda d: d.execute_script(_READ_PAGE_JS)["polls"] >= 1)
    before_key = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert before_key and all("/dashboard/data" in m and "401" in m for m in before_key)
    WebDriverWait(browser, 60).until(lambda d: d.execute_script(_READ_PAGE_JS)["polls"] >= 2)
    page = browser.execute_script(_READ_PAGE_JS)
    usages = [r["usage"] for r in responses]
    num_prompt = sum(u["prompt_tokens"] for u in usages)
    num_generated = sum(u["completion_tokens"] for u in usages)
    assert page["totalRequests"] == str(NUM_SAMPLES)
    assert page["promptTokens"] == f"{num_prompt:,}"
    assert page["generationTokens"] == f"{num_generated:,}"
    assert (page["overload"], page["breaker"]) == ("green", "closed")
    assert [row[0] for row in page["tenants"]] == ["gold", "free", "idle"]
    gold = page["tenants"][0][1]
    gold_usage = [r["usage"] for r in responses if r["tenant"] == "gold"]
    assert gold["prompt_tokens"] == f"{sum(u['prompt_tokens'] for u in gold_usage):,}"
    assert gold["slo_ttft"].startswith("100 % of 3 ")
    assert (gold["tier"], gold["requests_ok"], gold["requests_400"]) == ("best_effort", "3", "0")
    free = page["tenants"][1][1]
    assert (free["requests_ok"], free["requests_400"], free["requests_other"]) == ("2", "1", "0")
    assert [row[0] for row in page["latency"]] == ["ttft_s", "tpot_s", "e2e_s", "queue_s"]
    assert float(page["latency"][0][1]) == data["latency"]["ttft_s"]["p50"]
    expected = [n for layer in data["experts"]["layers"] for n in layer["num_tokens"]]
    assert page["expertCells"] == expected and page["frozen"] == 0
    assert page["requests"] == len(RUN)
    assert page["prefillBars"] == sum(len(t["prefill_chunks"]) for t in data["requests"])
    assert page["decodeBars"] == len(RUN)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
