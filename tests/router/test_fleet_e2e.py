"""The fleet end to end, as real processes on loopback: `sits router` in front of `sits serve`
replicas of a tiny checkpoint.

Two groups of processes, each started once for the module (once per worker that runs some of
its tests under `pytest -n N`; `--dist loadfile` keeps the module on one worker):
- `fleet`: a router and three replicas that register with it (heartbeats), all with one tenants
  file and the router's key: prefix affinity, a tenant's fleet-wide rate limit (a second router
  with `--tenants` in front of two of them), `kill -9` under load and the rejoin, SIGTERM drain
  under load.
- `side`: a stable replica, a canary with injected latency (registered with one router), a
  healthy canary (registered with another), and a router with the slow one as its primary and
  the stable one as `--fallback`: canary rollback and promotion, the predicted-P99 fallback.
Every wait is on an event (a router's `/v1/router/replicas`, `/v1/router/canary`, `/metrics`,
a process's exit); the client's read time-out (`READ_TIMEOUT_S`) is the bound that tells a hung
stream from a slow machine.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sits.bench.fleet_procs import LoopbackProcess
from sits.core.fleet import REPLICA_HEADER
from sits.tenancy import hash_api_key
from tests.router.live_fleet import (
    ROUTER_KEY,
    START_TIMEOUT_S,
    WAIT_S,
    LoadLoop,
    Processes,
    StreamCall,
    canary_view,
    client,
    complete,
    metric_sum,
    metrics,
    new_urls,
    port_of,
    prompt_landing_on,
    replica_command,
    replicas_view,
    router_command,
    start_streams,
    wait_for,
    wait_routed,
)

FLEET_KEY, LIMITED_KEY = "fleet-tenant-key", "limited-tenant-key"
FLEET = {"Authorization": f"Bearer {FLEET_KEY}"}
LIMITED = {"Authorization": f"Bearer {LIMITED_KEY}"}
LIMITED_RPM = 4  # one request back every 15 s: the test's few seconds never refill one
TENANTS = f"""
[[tenants]]
id = "fleet"
api_key_sha256 = ["{hash_api_key(FLEET_KEY)}"]

[[tenants]]
id = "limited"
api_key_sha256 = ["{hash_api_key(LIMITED_KEY)}"]
requests_per_minute = {LIMITED_RPM}
"""
CANARY_DELAY_S = 2.0  # the slow canary's and the slow primary's injected delay
SHORT = {"prompt": "Say something", "max_tokens": 4, "ignore_eos": True}


# --- the fleet: a router and three registered replicas ---------------------------------------
@dataclass
class Fleet:
    """The `fleet` fixture's processes."""

    procs: Processes
    router: LoopbackProcess
    router_url: str
    urls: list[str]
    replicas: dict[str, LoopbackProcess]
    commands: dict[str, list[str]]

    def restart(self, url: str) -> None:
        """Start the replica at `url` again (same command, same port) and wait for its health."""
        proc = self.procs.launch(f"replica-{self.urls.index(url)}", self.commands[url], url)
        self.replicas[url] = proc
        proc.wait_healthy(time.monotonic() + START_TIMEOUT_S)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One pooled client for every thread of the module's tests."""
    with client() as shared:
        yield shared


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    """The tiny random Llama checkpoint (dense: the fastest of the tiny models to start)."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    return path


@pytest.fixture(scope="module")
def fleet(model_dir: Path, tenants_file: Path, tmp_path_factory) -> Iterator[Fleet]:
    with Processes(tmp_path_factory.mktemp("fleet")) as procs:
        router_url, *urls = new_urls(4)
        # A long breaker cool-down: the killed replica's breaker stays open until it rejoins.
        command = router_command(port_of(router_url), "--breaker-cooldown", "600")
        router = procs.launch("router", command, router_url)
        fleet_flags = (
            "--register-with", router_url, "--router-key", ROUTER_KEY,
            "--tenants", str(tenants_file), "--enable-prompt-tokens-details",
            "--shutdown-timeout", "120",
        )  # fmt: skip
        commands = {url: replica_command(model_dir, port_of(url), *fleet_flags) for url in urls}
        replicas = {
            url: procs.launch(f"replica-{i}", commands[url], url) for i, url in enumerate(urls)
        }
        deadline_s = time.monotonic() + START_TIMEOUT_S
        for proc in replicas.values():
            proc.wait_healthy(deadline_s)
        wait_routed(router, router_url, urls)
        yield Fleet(procs, router, router_url, urls, replicas, commands)


def test_repeated_long_prompts_stick_to_one_replica_and_unrelated_ones_spread(
    fleet: Fleet, http: httpx.Client
) -> None:
    urls, router = fleet.urls, fleet.router_url
    target = urls[1]
    shared = prompt_landing_on(target, urls, "", "Shared system prompt")
    hits = "sits:prefix_cache_hits_total"
    before = {url: metrics(url)(hits) for url in urls}
    affine = metrics(router)("sits:router_routing_decisions_total", reason="prefix_affinity")
    repeated = [
        complete(http, router, {"prompt": shared, "max_tokens": 2}, FLEET) for _ in range(4)
    ]
    assert [r.status_code for r in repeated] == [200] * 4
    assert [r.headers[REPLICA_HEADER] for r in repeated] == [target] * 4
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in repeated]
    assert cached[0] == 0 and min(cached[1:]) > 0
    wait_for(lambda: metrics(target)(hits) - before[target] == sum(cached), "the hits counted")
    assert {url: metrics(url)(hits) - before[url] for url in urls} == {
        url: (sum(cached) if url == target else 0) for url in urls
    }
    # Unrelated prompts: each lands where its own key ranks first, so they spread.
    unrelated = [
        (url, prompt_landing_on(url, urls, "", f"Topic {k}")) for k in range(2) for url in urls
    ]
    answers = [complete(http, router, {"prompt": p, "max_tokens": 2}, FLEET) for _, p in unrelated]
    assert [r.status_code for r in answers] == [200] * len(unrelated)
    assert [r.headers[REPLICA_HEADER] for r in answers] == [url for url, _ in unrelated]
    assert {r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in answers} == {0}
    decided = metrics(router)("sits:router_routing_decisions_total", reason="prefix_affinity")
    assert decided - affine == len(repeated) + len(unrelated)


# --- a tenant's limit, once for the fleet ----------------------------------------------------
@pytest.fixture(scope="module")
def tenant_router(fleet: Fleet, tenants_file: Path) -> Iterator[str]:
    """A router with `--tenants` in front of the fleet's first two replicas (static)."""
    (url,) = new_urls(1)
    pair = fleet.urls[:2]
    replicas = [arg for u in pair for arg in ("--replica", u)]
    command = router_command(port_of(url), "--tenants", str(tenants_file), *replicas)
    proc = fleet.procs.launch("tenant-router", command, url)
    try:
        wait_routed(proc, url, pair)
        yield url
    finally:
        proc.kill()


def test_a_tenants_rate_limit_holds_across_two_replicas(
    fleet: Fleet, tenant_router: str, http: httpx.Client
) -> None:
    pair = fleet.urls[:2]
    prompts = [
        prompt_landing_on(pair[i % 2], pair, "limited", f"Question {i}") for i in range(LIMITED_RPM)
    ]
    requests = "sits:tenant_requests_total"
    before = {url: metric_sum(url, requests, tenant="limited", outcome="ok") for url in pair}
    served = [
        complete(http, tenant_router, {"prompt": p, "max_tokens": 2}, LIMITED) for p in prompts
    ]
    refused = complete(http, tenant_router, SHORT, LIMITED)
    assert [r.status_code for r in served] == [200] * LIMITED_RPM, [r.text for r in served]
    assert [r.headers[REPLICA_HEADER] for r in served] == [pair[i % 2] for i in range(LIMITED_RPM)]
    assert served[0].headers["x-ratelimit-limit-requests"] == str(LIMITED_RPM)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    # Each replica served its two as the tenant (the router's key named it); neither ever saw
    # a request of the tenant end otherwise (the 429 was the router's alone).
    after = {url: metric_sum(url, requests, tenant="limited", outcome="ok") for url in pair}
    assert {url: after[url] - before[url] for url in pair} == dict.fromkeys(pair, 2.0)
    assert sum(metric_sum(url, requests, tenant="limited") for url in pair) == sum(after.values())


def _status(router_url: str, url: str) -> str | None:
    return replicas_view(router_url).get(url, {}).get("status")


# --- kill -9 and SIGTERM under load ----------------------------------------------------------
STREAM = {"prompt": "Stream", "max_tokens": 200, "ignore_eos": True}
NEW = {"prompt": "New request", "max_tokens": 8}


def test_kill_9_of_a_replica_under_load_loses_no_request_that_had_not_started(
    fleet: Fleet, http: httpx.Client
) -> None:
    router, victim = fleet.router_url, fleet.urls[1]
    with LoadLoop(http, router, NEW, FLEET) as load:
        wait_for(lambda: load.count() >= 3, "load requests answered")
        streams = start_streams(http, router, STREAM, FLEET, 60)
        on_victim = [s for s in streams if s.replica == victim]
        others = [s for s in streams if s.replica != victim]
        assert len(on_victim) >= 5, [s.replica for s in streams]  # enough to open its breaker
        # The streams outlast their start many times over (sized for that, not timed).
        assert all(s.ended_s is None for s in on_victim), [len(s.frames) for s in on_victim]
        fleet.replicas[victim].kill()  # SIGKILL to its process group
        after_kill = start_streams(http, router, {**STREAM, "max_tokens": 20}, FLEET, 10)
        for stream in streams + after_kill:
            stream.join(WAIT_S)
        # Its running streams end with an error event (and [DONE]), never a hang.
        for stream in on_victim:
            assert stream.error is None, stream.describe()
            assert stream.frames[-1] == "[DONE]" and stream.error_code() == "replica_failed"
            assert len(stream.frames) >= 3, stream.describe()  # tokens came before the cut
        # Everything else was served whole, nothing new by the dead replica.
        for stream in others + after_kill:
            assert stream.finished(), stream.describe()
        assert {s.replica for s in after_kill} <= set(fleet.urls) - {victim}
        wait_for(lambda: _status(router, victim) == "down", "the killed replica is down")
        assert replicas_view(router)[victim]["breaker"] == "open"
        state = metrics(router)("sits:router_breaker_state", replica=victim, state="open")
        assert state == 1.0
        # A restart on the same port rejoins through its heartbeat: only a heartbeat of a DOWN
        # replica gives it a new breaker, and the old one stays open for 600 s.
        fleet.restart(victim)
        wait_routed(fleet.router, router, [victim])
        num_before_stop = load.count()
        wait_for(lambda: load.count() >= num_before_stop + 3, "load after the rejoin")
    failed = [r for r in load.results if r[0] != 200 or r[3] is not None]
    assert failed == [] and len(load.results) >= 6
    again = prompt_landing_on(victim, fleet.urls, "", "After the restart")
    answer = complete(http, router, {"prompt": again, "max_tokens": 2}, FLEET)
    assert answer.status_code == 200 and answer.headers[REPLICA_HEADER] == victim


def test_sigterm_of_a_replica_under_load_fails_no_request(fleet: Fleet, http: httpx.Client) -> None:
    router, victim = fleet.router_url, fleet.urls[2]
    proc = fleet.replicas[victim].proc
    assert proc is not None
    with LoadLoop(http, router, NEW, FLEET) as load:
        wait_for(lambda: load.count() >= 3, "load requests answered")
        streams = start_streams(http, router, {**STREAM, "max_tokens": 100}, FLEET, 30)
        on_victim = [s for s in streams if s.replica == victim]
        # Some of the victim's streams may already be done on an idle machine: the signal
        # must reach at least one that is still running.
        running = [s for s in on_victim if s.ended_s is None]
        assert running, [(s.replica, len(s.frames)) for s in streams]
        proc.send_signal(signal.SIGTERM)  # the server process alone, as `kill PID`
        assert proc.wait(WAIT_S) == 0  # it drained its streams, then exited
        num_at_exit = load.count()
        wait_for(lambda: load.count() >= num_at_exit + 3, "load after the exit")
    for stream in streams:
        stream.join(WAIT_S)
        assert stream.finished(), stream.describe()
    failed = [r for r in load.results if r[0] != 200 or r[3] is not None]
    assert failed == [] and len(load.results) >= 6
    assert victim not in replicas_view(router)  # it deregistered


# --- canaries and the fallback pool ----------------------------------------------------------
ROLLBACK_FLAGS = (
    "--canary-weight", "0.5", "--canary-steps", "0.5,1", "--canary-min-samples", "3",
    "--canary-step-hold", "0",
)  # fmt: skip
# Wide latency bounds: two copies of one model differ only by the busy machine's scheduling
# noise, which a P95 over 3 samples (their maximum) must not mistake for a regression. The
# rollback test checks the default bounds.
PROMOTE_FLAGS = (
    "--canary-weight", "0.25", "--canary-steps", "0.25,0.5,1", "--canary-min-samples", "3",
    "--canary-step-hold", "0", "--canary-max-ttft-ratio", "100", "--canary-max-tpot-ratio", "100",
)  # fmt: skip


@dataclass(frozen=True)
class Side:
    """The `side` fixture's URLs."""

    stable: str
    slow: str  # a canary of `rollback` and the primary of `fallback`
    fresh: str  # a healthy canary of `promote`
    rollback: str
    promote: str
    fallback: str


@pytest.fixture(scope="module")
def side(model_dir: Path, tmp_path_factory) -> Iterator[Side]:
    with Processes(tmp_path_factory.mktemp("side")) as procs:
        urls = Side(*new_urls(6))
        routers = {
            urls.rollback: ("--replica", urls.stable, *ROLLBACK_FLAGS),
            urls.promote: ("--replica", urls.stable, *PROMOTE_FLAGS),
            urls.fallback: (
                "--replica", urls.slow, "--fallback", urls.stable, "--fallback-p99-ms", "500",
            ),
        }  # fmt: skip
        router_procs = {
            url: procs.launch(f"router-{i}", router_command(port_of(url), *flags), url)
            for i, (url, flags) in enumerate(routers.items())
        }
        canary = ("--router-key", ROUTER_KEY, "--version-label", "canary")
        fault = ("--fault-injection", f"delay={CANARY_DELAY_S:g}@100", "--enable-fault-injection")
        replicas = {
            "stable": (urls.stable, ()),
            "slow-canary": (urls.slow, ("--register-with", urls.rollback, *canary, *fault)),
            "fresh-canary": (urls.fresh, ("--register-with", urls.promote, *canary)),
        }
        replica_procs = [
            procs.launch(name, replica_command(model_dir, port_of(url), *flags), url)
            for name, (url, flags) in replicas.items()
        ]
        deadline_s = time.monotonic() + START_TIMEOUT_S
        for proc in replica_procs:
            proc.wait_healthy(deadline_s)
        wait_routed(router_procs[urls.rollback], urls.rollback, [urls.stable, urls.slow])
        wait_routed(router_procs[urls.promote], urls.promote, [urls.stable, urls.fresh])
        wait_routed(router_procs[urls.fallback], urls.fallback, [urls.slow, urls.stable])
        for url in (urls.rollback, urls.promote):  # the probe round starts the canary
            wait_for(lambda u=url: canary_view(u)["state"] == "ramping", "the canary ramps")
        yield urls


def _drive(
    http: httpx.Client, router_url: str, max_requests: int, while_state: str | None = None
) -> list[str]:
    """Send short streamed requests one at a time, each accounted by the router (its breaker,
    predictor and canary saw it end) before the next, `max_requests` of them or until the
    canary leaves `while_state`; returns the replicas that served them."""
    base = metric_sum(router_url, "sits:router_requests_total")
    served: list[str] = []
    for i in range(max_requests):
        call = StreamCall(http, router_url, {**SHORT, "prompt": f"Question {i}"}, {})
        call.run()  # in this thread
        assert call.finished(), call.describe()
        assert call.replica is not None
        served.append(call.replica)
        num = len(served)
        wait_for(
            lambda n=num: metric_sum(router_url, "sits:router_requests_total") - base >= n,
            "the router accounted the request",
        )
        if while_state is not None and canary_view(router_url)["state"] != while_state:
            break
    return served


def test_a_canary_with_injected_latency_is_rolled_back(side: Side, http: httpx.Client) -> None:
    served = _drive(http, side.rollback, 60, while_state="ramping")
    state = canary_view(side.rollback)
    assert state["state"] == "rolled_back" and state["weight"] == 0.0
    history = state["history"]
    assert [(h["state"], h["to_weight"]) for h in history] == [
        ("ramping", 0.5),
        ("rolled_back", 0.0),
    ]
    assert history[-1]["reason"].startswith("rollback: canary ttft p95 "), history[-1]
    # The decision came with the third request of the side that had fewer.
    assert min(served.count(side.slow), served.count(side.stable)) == 3, served
    assert _drive(http, side.rollback, 6) == [side.stable] * 6
    value = metrics(side.rollback)
    assert value("sits:router_canary_weight") == 0.0
    assert value("sits:router_canary_state", state="rolled_back") == 1.0


def test_a_healthy_canary_is_promoted_to_all_traffic(side: Side, http: httpx.Client) -> None:
    served = _drive(http, side.promote, 200, while_state="ramping")
    state = canary_view(side.promote)
    assert state["state"] == "promoted" and state["weight"] == 1.0
    history = state["history"]
    assert [(h["state"], h["to_weight"]) for h in history] == [
        ("ramping", 0.25),
        ("ramping", 0.5),
        ("promoted", 1.0),
    ]
    assert all(h["reason"].startswith("within bounds over ") for h in history[1:]), history
    assert set(served) == {side.stable, side.fresh}
    value = metrics(side.promote)
    assert value("sits:router_canary_weight") == 1.0
    assert value("sits:router_canary_state", state="promoted") == 1.0


def test_a_slow_primary_sends_new_requests_to_the_fallback_replica(
    side: Side, http: httpx.Client
) -> None:
    decisions = "sits:router_routing_decisions_total"
    before = {
        reason: metrics(side.fallback)(decisions, reason=reason)
        for reason in ("only_candidate", "fallback")
    }
    served = _drive(http, side.fallback, 5)
    # The first one measured the primary's TTFT (>= the injected delay): no later one goes there.
    assert served == [side.slow] + [side.stable] * 4
    value = metrics(side.fallback)
    assert value(decisions, reason="only_candidate") - before["only_candidate"] == 1
    assert value(decisions, reason="fallback") - before["fallback"] == 4
