"""The router's forwarding against scripted replicas on loopback: failover before the first
byte, no replay after it, breakers, draining, streams relayed frame by frame."""

from __future__ import annotations

import json

import httpx
import pytest

from sits.admission import BreakerConfig
from sits.router.app import build_router_app
from sits.router.registry import ReplicaStatus
from sits.router.settings import RouterSettings
from tests.router.fakes import FakeReplica, closed_port_url, serve, wait_until

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _router(replicas: list[str], **kwargs: object) -> object:
    settings = RouterSettings(replicas=tuple(replicas), **kwargs)
    return build_router_app(settings, probe=False)


def _events(text: str) -> list[str]:
    return [part.removeprefix("data: ") for part in text.split("\n\n") if part]


def _metric(client: httpx.Client, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_refused_connection_is_retried_and_opens_the_breaker_after_five() -> None:
    ok = FakeReplica()
    dead = closed_port_url()
    breaker = BreakerConfig(max_consecutive_failures=5, open_s=600)
    with serve(ok.app()) as ok_url:
        app = _router([dead, ok_url], breaker=breaker, load_bound=1000.0)
        with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
            app.state.router.registry.get(ok_url).inflight = 100  # the dead one looks idler
            for _ in range(8):
                response = client.post("/v1/completions", json=BODY)
                assert response.status_code == 200
                assert response.headers["x-sits-replica"] == ok_url
                assert response.json()["choices"][0]["text"] == "t0t1t2t3"
            registry = app.state.router.registry
            assert registry.get(dead).breaker.state.value == "open"
            retries = _metric(client, "sits:router_retries_total")
    assert len(ok.seen) == 8  # the dead one was tried first until its breaker opened
    assert retries == 5


def test_draining_takes_the_replica_out_at_once_and_the_request_succeeds() -> None:
    draining, ok = FakeReplica(behaviour="draining"), FakeReplica()
    with serve(draining.app()) as d_url, serve(ok.app()) as ok_url:
        app = _router([d_url, ok_url])
        with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
            app.state.router.registry.get(ok_url).inflight = 100  # the draining one looks idler
            for _ in range(4):
                assert client.post("/v1/completions", json=BODY).status_code == 200
            status = app.state.router.registry.get(d_url).status
            breaker = app.state.router.registry.get(d_url).breaker
    assert status is ReplicaStatus.DRAINING
    assert len(draining.seen) == 1  # out of rotation after its first 503
    assert len(ok.seen) == 4
    assert breaker.window_counts() == (0, 0)  # a drain is no failure


@pytest.mark.parametrize("behaviour", ["engine_dead", "hang"])
def test_engine_dead_and_no_first_byte_are_retried(behaviour: str) -> None:
    bad, ok = FakeReplica(behaviour=behaviour), FakeReplica()
    with serve(bad.app()) as bad_url, serve(ok.app()) as ok_url:
        app = _router([bad_url], first_byte_timeout_s=0.5)
        with serve(app) as router_url, httpx.Client(base_url=router_url, timeout=30) as client:
            app.state.router.registry.add_static(ok_url)
            ok_replica = app.state.router.registry.get(ok_url)
            for _ in range(2):
                ok_replica.inflight = 100  # the bad one looks idler: it is tried first
                response = client.post("/v1/completions", json={**BODY, "stream": True})
                assert response.status_code == 200
                events = _events(response.text)
                assert events[-1] == "[DONE]"
                assert all("error" not in e for e in events)
                wait_until(lambda r=ok_replica: r.inflight == 100, "the stream accounted")
    assert len(bad.seen) == 2
    assert len(ok.seen) == 2


def test_a_stream_cut_after_tokens_ends_with_an_error_event_and_is_not_replayed() -> None:
    cut, ok = FakeReplica(behaviour="cut:2"), FakeReplica()
    with serve(cut.app()) as cut_url, serve(ok.app()) as ok_url:
        app = _router([cut_url])
        with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
            app.state.router.registry.add_static(ok_url)
            app.state.router.registry.get(ok_url).inflight = 100  # the cut one is chosen
            response = client.post("/v1/completions", json={**BODY, "stream": True})
            cut_replica = app.state.router.registry.get(cut_url)
            wait_until(lambda: cut_replica.inflight == 0, "the stream accounted")
            failures = cut_replica.breaker.window_counts()
            cuts = _metric(client, "sits:router_replica_errors_total")
    events = _events(response.text)
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:3]]
    assert texts == ["", "t0", "t1"]  # what the replica sent, once
    assert json.loads(events[3])["error"]["code"] == "replica_failed"
    assert events[4:] == ["[DONE]"]
    assert len(ok.seen) == 0  # never replayed elsewhere
    assert failures == (1, 1)
    assert cuts == 1  # kind="stream_cut"


def test_a_500_is_the_replicas_answer_and_counts_against_it() -> None:
    bad = FakeReplica(behaviour="status_500")
    with serve(bad.app()) as bad_url:
        app = _router([bad_url])
        with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
            response = client.post("/v1/completions", json=BODY)
            failures = app.state.router.registry.get(bad_url).breaker.window_counts()
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal"
    assert len(bad.seen) == 1
    assert failures == (1, 1)


def test_a_replica_shedding_under_overload_is_not_failing() -> None:
    shedding = FakeReplica(behaviour="overloaded")
    with serve(shedding.app()) as url:
        app = _router([url])
        with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
            response = client.post("/v1/completions", json=BODY)
            counts = app.state.router.registry.get(url).breaker.window_counts()
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "overloaded"  # the replica's answer, relayed
    assert counts == (1, 0)


def test_no_replica_left_is_a_503_with_retry_after() -> None:
    app = _router([closed_port_url(), closed_port_url()])
    with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
        response = client.post("/v1/completions", json=BODY)
        assert client.get("/health").status_code == 200  # no probe ran: both still listed
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    body = response.json()["error"]
    assert body["code"] == "no_replica"
    assert "fake-model" in body["message"]


def test_streams_pass_through_frame_by_frame_with_the_replicas_headers() -> None:
    replica = FakeReplica(num_tokens=6)
    with (
        serve(replica.app()) as url,
        serve(_router([url])) as router_url,
        httpx.Client(base_url=router_url) as client,
        client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r,
    ):
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-sits-replica"] == url
        frames = list(r.iter_text())
    text = "".join(frames)
    events = _events(text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [
        "",
        *(f"t{i}" for i in range(6)),
    ]
    assert events[-1] == "[DONE]"
    assert "stream_options" not in replica.seen[0]["body"]  # without tenants: sent as is


def test_a_model_no_replica_serves_is_a_404() -> None:
    replica = FakeReplica()
    with serve(replica.app()) as url:
        app = _router([url])
        with serve(app) as router_url, httpx.Client(base_url=router_url) as client:
            app.state.router.registry.set_models(url, ("fake-model",), 1024)
            response = client.post("/v1/completions", json={**BODY, "model": "other"})
            served = client.post("/v1/completions", json=BODY)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert served.status_code == 200
    assert len(replica.seen) == 1


def test_a_client_that_leaves_cancels_its_attempt() -> None:
    slow = FakeReplica(behaviour="sleep:600")
    with serve(slow.app()) as url:
        app = _router([url])
        with serve(app) as router_url:
            with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=router_url) as client:
                client.post("/v1/completions", json=BODY, timeout=0.5)
            replica = app.state.router.registry.get(url)
            wait_until(lambda: replica.inflight == 0, "the attempt cancelled")
            breaker = replica.breaker.window_counts()
    assert len(slow.seen) == 1
    assert breaker == (0, 0)  # a client leaving says nothing about the replica
