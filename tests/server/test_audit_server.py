"""The audit log of a live server (`--audit-log`): one record per request, refused requests
(400, 401, 429) too, a keyed log with checkpoints; and the prefix-cache counters on /metrics."""

from __future__ import annotations

import json
import os
import stat

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sits.admission import FakeClock
from sits.obs import AuditKey, find_records, verify_log
from sits.obs.request_audit import AuditSettings
from sits.obs.tracing import TracingSettings
from sits.server.context import ServerSettings
from sits.server.qos.admit import QosSettings
from sits.tenancy import TenantsConfig
from tests.server.live import LiveServer, metric_samples
from tests.server.tenant_fixtures import NEVER_OVERLOADED, auth, tenant, tenant_engine

PROMPT = "def fibonacci(n):"


def _requests(log) -> list[dict]:
    """The request records of a one-file log (its header and refusals left out)."""
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines[0]["kind"] == "header"
    return [r for r in lines if r["kind"] == "request"]


def _post(live: LiveServer, path: str, body: dict) -> dict:
    with live.http() as http:
        resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _disconnect_after_first_chunk(live: LiveServer, body: dict) -> str:
    with (
        httpx.Client(base_url=live.base_url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[len("data: ") :])["id"]
    raise AssertionError("no chunk")


def _stream_id(live: LiveServer, body: dict) -> str:
    with live.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        ids = {json.loads(x[6:])["id"] for x in resp.iter_lines() if x.startswith("data: {")}
    assert len(ids) == 1
    return ids.pop()


def test_audit_one_record_per_request(tmp_path, tiny_moe_dir, engine_factory) -> None:
    log = tmp_path / "audit.jsonl"
    settings = ServerSettings(audit=AuditSettings(path=str(log), top_logprobs=3))
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live:
        cmpl = _post(
            live,
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2},
        )
        chat = _post(
            live,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        n2 = _post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2})
        multi = _post(live, "/v1/completions", {"prompt": ["a b", "c d"], "max_tokens": 2})
        streamed = _stream_id(
            live,
            {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 3, "stream": True},
        )
        aborted = _disconnect_after_first_chunk(
            live,
            {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True},
        )
        assert live.wait_until(lambda: live.engine.stats().num_running == 0)
    result = verify_log(log)
    assert result.ok and result.num_refusals == 0, result
    lines = _requests(log)
    ids = [r["request_id"] for r in lines]
    expected = [cmpl["id"], chat["id"], n2["id"], multi["id"] + "-0", multi["id"] + "-1"]
    expected += [streamed, aborted]
    assert sorted(ids) == sorted(expected)
    (rec,) = find_records(log, cmpl["id"])
    (out,) = rec["outputs"]
    api = cmpl["choices"][0]["logprobs"]
    assert len(out["token_ids"]) == len(api["tokens"]) == 5
    assert [t["logprob"] for t in out["tokens"]] == api["token_logprobs"]
    for token, top in zip(out["tokens"], api["top_logprobs"], strict=True):
        assert len(token["top"]) == 3  # the audit's K, more than the user's 2
        # the API's top entries (keyed by text, so equal texts merge) are audited ones
        assert set(top.values()) <= {lp for _, lp in token["top"][:2]} | {token["logprob"]}
    assert out["text"] == cmpl["choices"][0]["text"]
    (rec_n2,) = find_records(log, n2["id"])
    assert [o["index"] for o in rec_n2["outputs"]] == [0, 1]
    assert rec["input"] is None and rec["weights_digest"] != "unknown"
    (rec_abort,) = find_records(log, aborted)
    assert rec_abort["outputs"][0]["finish_reason"] == "abort"
    assert rec_abort["sampling"]["logprobs"] is None  # the user's params
    assert [r["trace_id"] for r in lines] == [None] * len(lines)  # tracing is off


def test_audit_records_carry_the_trace_id(tmp_path, tiny_moe_dir, engine_factory) -> None:
    log = tmp_path / "audit.jsonl"
    exporter = InMemorySpanExporter()
    settings = ServerSettings(
        audit=AuditSettings(path=str(log)),
        tracing=TracingSettings(sample_ratio=1.0, exporter=exporter),
    )
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with LiveServer(engine_factory(tiny_moe_dir), settings) as live, live.http() as http:
        single = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        multi = http.post("/v1/completions", json={"prompt": ["a b", "c d"], "max_tokens": 2})
        chat = http.post("/v1/chat/completions", json=chat_body)
    # the server has stopped: every span is exported and every record written
    roots = {
        span.attributes["gen_ai.response.id"]: format(span.context.trace_id, "032x")
        for span in exporter.get_finished_spans()
        if span.parent is None and span.name.startswith("POST ")
    }
    for resp, suffixes in ((single, [""]), (multi, ["-0", "-1"]), (chat, [""])):
        assert resp.status_code == 200, resp.text
        request_id = resp.json()["id"]
        trace_id = roots[request_id]
        assert resp.headers["traceparent"].split("-")[1] == trace_id
        for suffix in suffixes:
            (record,) = find_records(log, request_id + suffix)
            assert record["trace_id"] == trace_id
    assert len(set(roots.values())) == 3


def test_responses_identical_with_and_without_audit(tmp_path, tiny_moe_dir, engine_factory) -> None:
    bodies = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
    ]

    def answers(settings: ServerSettings) -> list[dict]:
        with LiveServer(engine_factory(tiny_moe_dir), settings) as live:
            out = []
            for path, body in bodies:
                resp = _post(live, path, body)
                for key in ("id", "created"):
                    resp.pop(key)
                out.append(resp)
            return out

    audited = ServerSettings(audit=AuditSettings(path=str(tmp_path / "a.jsonl")))
    assert answers(audited) == answers(ServerSettings())


def test_refused_requests_are_audited_in_a_keyed_log(tmp_path, tiny_moe_dir) -> None:
    """401, 429 and 400s (a body FastAPI refuses, a value the handler refuses) each leave a
    record with the status and reason and nothing of the request; the log and its checkpoint
    file are private and verify with the key."""
    tenants = TenantsConfig((tenant("acme", requests_per_minute=1),))
    key = AuditKey.from_secret(b"the server's audit key, 32 bytes")
    log, checkpoints = tmp_path / "audit.jsonl", tmp_path / "audit.checkpoints"
    audit = AuditSettings(
        path=str(log), key=key, checkpoint_path=str(checkpoints), checkpoint_every_records=2
    )
    qos = QosSettings(clock=FakeClock(1000.0), overload=NEVER_OVERLOADED)
    settings = ServerSettings(tenants=tenants, qos=qos, audit=audit)
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    with LiveServer(tenant_engine(tiny_moe_dir, tenants), settings) as live, live.http() as http:
        headers = auth("acme")
        bad_json = http.post(
            "/v1/completions",
            content=b"{not json",
            headers={**headers, "content-type": "application/json"},
        )
        bad_value = http.post("/v1/completions", json={**body, "max_tokens": -1}, headers=headers)
        served = http.post("/v1/completions", json=body, headers=headers)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        limited = http.post("/v1/chat/completions", json=chat, headers=headers)
        unknown = http.post("/v1/completions", json=body, headers=auth("mallory"))
    answers = [bad_json, bad_value, served, limited, unknown]
    assert [r.status_code for r in answers] == [400, 400, 200, 429, 401]
    result = verify_log(log, key=key, checkpoint_path=str(checkpoints))
    assert result.ok, result.chain_break
    assert (result.num_headers, result.num_requests, result.num_refusals) == (1, 1, 4)
    assert result.checkpoints[-1].reason == "shutdown"
    assert result.checkpoints[-1].num_records == 6
    for path in (log, checkpoints):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    records = [json.loads(x) for x in log.read_text().splitlines()][1:]
    refusals = [r for r in records if r["kind"] == "refused"]
    (request,) = [r for r in records if r["kind"] == "request"]
    assert request["request_id"] == served.json()["id"] and request["tenant"] == "acme"
    got = [(r["status"], r["tenant"], r["route"], r["error"]["code"]) for r in refusals]
    assert sorted(got, key=str) == sorted(
        [
            (400, "acme", "POST /v1/completions", None),
            (400, "acme", "POST /v1/completions", "invalid_value"),
            (429, "acme", "POST /v1/chat/completions", "rate_limit_exceeded"),
            (401, None, "POST /v1/completions", "invalid_api_key"),
        ],
        key=str,
    )
    for refusal, answer in zip(
        sorted(refusals, key=lambda r: r["status"]),
        sorted([bad_json, bad_value, limited, unknown], key=lambda r: r.status_code),
        strict=True,
    ):
        assert refusal["error"]["type"] == answer.json()["error"]["type"]
        assert refusal["request_id"].startswith("refused-") and not refusal["engine_started"]
        assert set(refusal) == {
            "schema", "kind", "time", "request_id", "tenant", "route", "status", "error",
            "engine_started", "trace_id", "seq", "prev_hash", "hash",
        }  # fmt: skip
    messages = {r["error"]["message"] for r in refusals}
    assert bad_value.json()["error"]["message"] in messages
    assert unknown.json()["error"]["message"] in messages
    assert PROMPT not in log.read_text()  # no input in clear without --audit-store-input


def test_engine_refusal_shares_the_request_id(tmp_path, tiny_moe_dir, engine_factory) -> None:
    """A 400 the engine gives (more KV blocks than the whole cache) after the job started: the
    engine request's record and the refusal's share the id."""
    small_kv_bytes = (16 << 20) * 40 // 2048  # 40 blocks of 16 tokens: 1,000 tokens cannot fit
    log = tmp_path / "audit.jsonl"
    settings = ServerSettings(audit=AuditSettings(path=str(log)))
    make_engine = engine_factory(tiny_moe_dir, kv_cache_memory_bytes=small_kv_bytes)
    with LiveServer(make_engine, settings) as live, live.http() as http:
        refused = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1000})
    assert refused.status_code == 400
    assert verify_log(log).ok
    (request,) = _requests(log)
    shared = find_records(log, request["request_id"])  # in the order they were submitted
    (refusal,) = [r for r in shared if r["kind"] == "refused"]
    assert len(shared) == 2 and refusal["engine_started"] is True
    assert (refusal["status"], refusal["tenant"]) == (400, "default")
    assert refusal["error"]["message"] == refused.json()["error"]["message"]


def test_prefix_cache_counters(server) -> None:
    def scrape() -> tuple[float, float]:
        with server.http() as http:
            samples = metric_samples(http.get("/metrics").text)
        get = {name: v for (name, _labels), v in samples.items()}
        return get["sits:prefix_cache_queries_total"], get["sits:prefix_cache_hits_total"]

    prompt = list(range(10, 10 + 70))  # 70 tokens: 4 full blocks of 16
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    _post(server, "/v1/completions", body)
    queries0, hits0 = scrape()
    _post(server, "/v1/completions", body)
    queries1, hits1 = scrape()
    assert hits1 - hits0 == 64
    assert queries1 - queries0 == 70
