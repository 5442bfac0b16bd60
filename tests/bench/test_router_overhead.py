"""bench/router_overhead.py's library on tiny fleets of real processes on loopback: exact request,
error and routing counts of both arms, and of a `kill -9` of one replica under streams (no timing
assertions). Also the paced fake replica's answers and the failure classes, in process.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from sits.bench.client import STREAM_CUT_ERROR
from sits.bench.fleet_procs import ReplicaSpec
from sits.bench.records import RequestRecord
from sits.bench.router_kill import KillConfig, failure_kind, run_kill_test
from sits.bench.router_overhead import main
from sits.testing.fake_replica import FakeReplicaConfig, build_fake_replica_app

FAST = ReplicaSpec("fake", ttft_ms=1.0, itl_ms=1.0, output_len=4)


def test_overhead_counts(tmp_path: Path, capsys) -> None:
    out = tmp_path / "r.json"
    code = main([
        "--replicas", "1", "--concurrency", "4", "--num-requests", "8", "--rounds", "1",
        "--output-len", "4", "--ttft-ms", "1", "--itl-ms", "1", "--no-kill-test",
        "--log-dir", str(tmp_path / "logs"), "--json", str(out),
    ])  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert [(r["round"], r["arm"]) for r in doc["rounds"]] == [(0, "direct"), (0, "router")]
    for arm in ("direct", "router"):
        s = doc["arms"][arm]["summary"]
        assert (s["num_requests"], s["completed"], s["failed"]) == (8, 8, 0), arm
        assert s["total_output_tokens"] == 8 * 4
        assert s["ttft_ms"]["count"] == 8
    # The router saw the 4 warm-up requests and the 8 timed ones, each routed to its only replica.
    assert doc["router_metrics"] == {"decisions": {"only_candidate": 12.0}, "retries": {}}
    assert doc["kill_test"] is None and doc["model"] == "fake"
    assert set(doc["comparison"]) >= {"added_ttft_p50_ms", "throughput_ratio", "met"}
    printed = capsys.readouterr().out
    assert "| direct | 8 | 0 |" in printed and "| router | 8 | 0 |" in printed
    assert "Router added TTFT: p50" in printed


def test_kill_test_counts(tmp_path: Path) -> None:
    # 6 streams spread 2/2/2 by least load (ties by url); 3 new requests then wait on one replica
    # each for their first token when one replica is killed; 3 more follow. The killed replica's
    # 2 streams end with an error event; its pending request is retried elsewhere, and every
    # request that had not started succeeds on the 2 others.
    spec = ReplicaSpec("fake", ttft_ms=1.0, itl_ms=30.0, output_len=100)
    cfg = KillConfig(
        replicas=3, streams=6, new_requests=6, output_len=100, timeout_s=30.0, ttft_ms=500.0
    )
    doc = asyncio.run(run_kill_test(spec, cfg, tmp_path / "kill"))
    c = doc["counts"]
    assert c["started_on_killed"] == 2
    assert c["started_on_killed_by_outcome"] == {"error_event": 2}
    assert (c["started_elsewhere"], c["started_elsewhere_failed"]) == (4, 0)
    assert (c["pending_at_kill"], c["pending_on_killed"]) == (3, 1)
    assert (c["not_started"], c["lost_not_started"], c["lost_errors"]) == (6, 0, [])
    served = c["not_started_served_by"]
    assert sum(served.values()) == 6 and c["victim"] not in served
    assert all(c["met"].values()), c["met"]
    assert sum(doc["router"]["retries"].values()) >= 1  # at least the pending one
    assert doc["router"]["victim_status"] == "down"


def test_fake_replica_stream_and_body() -> None:
    app = build_fake_replica_app(FakeReplicaConfig(ttft_ms=0.0, itl_ms=0.0, output_len=3))

    async def go() -> tuple[list[str], dict, dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            body = {"model": "fake", "prompt": "a b c", "max_tokens": 10, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            frames = [line for line in response.text.split("\n\n") if line]
            plain = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 2,
            })  # fmt: skip
            models = await client.get("/v1/models")
        return frames, plain.json(), models.json()

    frames, plain, models = asyncio.run(go())
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:3]] == [" t0", " t1", " t2"]
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}  # fmt: skip
    assert '"choices":[]' in frames[3]  # compact JSON, as the router's relay expects
    assert plain["choices"][0]["message"]["content"] == " t0 t1"
    assert plain["usage"]["completion_tokens"] == 2
    assert models["data"][0]["id"] == "fake"


def test_failure_kinds() -> None:
    def rec(**kw: object) -> RequestRecord:
        r = RequestRecord(0, "t", 0.0, 0, 1)
        for k, v in kw.items():
            setattr(r, k, v)
        return r

    assert failure_kind(rec(ok=True, status=200)) is None
    assert failure_kind(rec(status=503, error="no replica")) == "status"
    assert failure_kind(rec(status=200, error=STREAM_CUT_ERROR)) == "cut"
    assert failure_kind(rec(status=200, error="ReadTimeout: timed out")) == "timeout"
    assert failure_kind(rec(status=200, error="RemoteProtocolError: closed")) == "transport"
    assert failure_kind(rec(status=None, error="ConnectError: refused")) == "transport"
    assert failure_kind(rec(status=200, error="The replica serving this failed")) == "error_event"
