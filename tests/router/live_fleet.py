"""Real fleets on loopback for the router's end-to-end tests: `sits serve` replicas of a tiny
checkpoint and `sits router` processes, their views, and clients that load them.

Every process is a `sits.bench.fleet_procs.LoopbackProcess` (its own process group, a log file);
a `Processes` set owns them and kills every group when it closes, whatever happened. Readiness
is waited for, never slept for: a replica is up when its `/health` answers 200, a router when
`GET /v1/router/replicas` (with `ROUTER_KEY`) shows what the test needs. Children run with
OMP_NUM_THREADS=1 (`child_env`), as the rest of the suite's servers. Only 127.0.0.1 is used.
The clients (`StreamCall`, `LoadLoop`) run in threads and record what came back (status, the
serving replica from `x-sits-replica`, the SSE frames, any exception) for exact assertions.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sits.bench.fleet_procs import LoopbackProcess, wait_until
from sits.bench.server_proc import free_port, serve_command
from sits.core.fleet import REPLICA_HEADER
from sits.router.policy import prefix_key, rendezvous_rank
from tests.server.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.server.live import metric_samples

ROUTER_KEY = "e2e-router-key"
ADMIN = {"Authorization": f"Bearer {ROUTER_KEY}"}
START_TIMEOUT_S = 240.0  # a whole fleet starting on 2 busy cores
WAIT_S = 120.0  # bound of every wait on an event (guards against a hang only)
READ_TIMEOUT_S = 30.0  # a client read that waits longer counts as a hang
PROMPT_CHARS = 600  # a "long" prompt: two whole 256-character blocks of the prefix key


@contextlib.contextmanager
def child_env() -> Iterator[None]:
    """OMP_NUM_THREADS=1 in the environment a child started in the block inherits."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


class Processes:
    """The processes of one fleet; `close()` SIGKILLs every process group (a context manager).

    Args:
        log_dir: where the logs go (`NAME.log`).
    """

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[LoopbackProcess] = []

    def launch(self, name: str, command: Sequence[str], url: str) -> LoopbackProcess:
        """Start `command` (does not wait), logging to `log_dir/name.log`."""
        log = self.log_dir / f"{name}.log"
        for n in range(1, 100):  # a restart keeps the old log
            if not log.exists():
                break
            log = self.log_dir / f"{name}.{n}.log"
        proc = LoopbackProcess(name, command, url + "/health", log)
        self.started.append(proc)
        with child_env():
            proc.launch()
        return proc

    def close(self) -> None:
        """SIGKILL every process group started here and reap it (all of them, whatever one of
        them raises; the first error is raised at the end)."""
        errors: list[BaseException] = []
        for proc in self.started:
            try:
                proc.kill()
            except BaseException as exc:  # noqa: BLE001 - the others are killed first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def replica_command(model: Path, port: int, *extra: str) -> list[str]:
    """`sits serve` of the tiny checkpoint on 127.0.0.1:`port` (the server tests' settings)."""
    return serve_command(
        str(model),
        port,
        [
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--log-level", "warning",
            *extra,
        ],
    )  # fmt: skip


def router_command(port: int, *extra: str) -> list[str]:
    """`sits router` on 127.0.0.1:`port` with `ROUTER_KEY`."""
    return [
        sys.executable, "-m", "sits.cli.main", "router",
        "--host", "127.0.0.1", "--port", str(port),
        "--router-key", ROUTER_KEY, "--log-level", "warning",
        *extra,
    ]  # fmt: skip


def new_urls(count: int) -> list[str]:
    """`count` distinct loopback URLs on ports that were free a moment ago."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return [f"http://127.0.0.1:{port}" for port in ports]


def port_of(url: str) -> int:
    """The port of a `http://127.0.0.1:PORT` URL."""
    return int(url.rsplit(":", 1)[1])


# --- views -----------------------------------------------------------------------------------
def replicas_view(router_url: str) -> dict[str, dict[str, Any]]:
    """The router's replicas by url (`GET /v1/router/replicas`); {} when it does not answer."""
    try:
        response = httpx.get(f"{router_url}/v1/router/replicas", headers=ADMIN, timeout=5)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    return {r["url"]: r for r in response.json()["data"]}


def canary_view(router_url: str) -> dict[str, Any]:
    """The router's canary snapshot (`GET /v1/router/canary`)."""
    response = httpx.get(f"{router_url}/v1/router/canary", headers=ADMIN, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


def metrics(url: str) -> Callable[..., float]:
    """Scrape `url`/metrics once; returns `value(name, **labels)` (labels without model_name;
    0 for a sample that is not there)."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    samples = metric_samples(response.text)

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    return value


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` at `url`/metrics that carry `labels` (and any others)."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    wanted = set(labels.items())
    return sum(
        value
        for (sample, sample_labels), value in metric_samples(response.text).items()
        if sample == name and wanted <= set(sample_labels)
    )


def healthy(view: dict[str, dict[str, Any]], urls: Sequence[str], models: bool = True) -> bool:
    """Every url is in the router's view, healthy with a closed breaker (and its models known)."""
    return all(
        url in view
        and view[url]["status"] == "healthy"
        and view[url]["breaker"] == "closed"
        and (bool(view[url]["models"]) or not models)
        for url in urls
    )


def wait_routed(
    router: LoopbackProcess, router_url: str, urls: Sequence[str], models: bool = True
) -> None:
    """Wait until the router routes to every url (`healthy`), while the router runs."""
    wait_until(
        router,
        lambda: healthy(replicas_view(router_url), urls, models),
        time.monotonic() + START_TIMEOUT_S,
        f"routing to {list(urls)}",
    )


def wait_for(predicate: Callable[[], object], what: str, bound_s: float = WAIT_S) -> None:
    """Poll `predicate` every 50 ms until it holds; `bound_s` guards against a hang only."""
    end_s = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < end_s, f"never happened: {what}"
        time.sleep(0.05)


# --- prompts ---------------------------------------------------------------------------------
def long_prompt(stem: str) -> str:
    """A prompt of `PROMPT_CHARS` characters that starts with `stem` (so its prefix key is
    `stem`'s own)."""
    filler = " the lighthouse keeper counts the ships that pass the rocks at night."
    text = f"{stem}:"
    while len(text) < PROMPT_CHARS:
        text += filler
    return text[:PROMPT_CHARS]


def prompt_landing_on(target: str, urls: Sequence[str], tenant: str, stem: str) -> str:
    """A long prompt whose prefix key (of `tenant`) ranks `target` first among `urls`: where the
    router's prefix affinity sends it (`sits.router.policy`)."""
    for n in range(10_000):
        text = long_prompt(f"{stem} {n}")
        key = prefix_key(tenant, text)
        assert key is not None
        if rendezvous_rank(key, urls)[0] == target:
            return text
    raise AssertionError(f"no prompt lands on {target}")


# --- clients ---------------------------------------------------------------------------------
def client() -> httpx.Client:
    """A client for many threads at once (one pool: a client per thread costs an SSL context
    each, which slows a burst of 60 down to seconds)."""
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    return httpx.Client(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=10), limits=limits)


def complete(
    http: httpx.Client, router_url: str, body: dict[str, Any], headers: dict[str, str]
) -> httpx.Response:
    """One non-streamed POST /v1/completions through the router."""
    return http.post(f"{router_url}/v1/completions", json=body, headers=headers)


def sse_lines(texts: Iterator[str]) -> Iterator[str]:
    """The lines of an event stream, split at newlines only, as the SSE spec and the `openai`
    client split them: httpx's `iter_lines` also splits at U+2028, U+0085 and the like, which
    JSON carries unescaped inside a token's text (a random model's output holds them)."""
    buffer = ""
    for text in texts:
        buffer += text
        *lines, buffer = buffer.split("\n")
        yield from (line.removesuffix("\r") for line in lines)
    if buffer:
        yield buffer


class StreamCall(threading.Thread):
    """One streamed completion through the router, read in a thread.

    Attributes (read after `join`): status, replica (`x-sits-replica`), frames (the `data:`
    payloads, "[DONE]" included), error (an exception of the client: a refused connection, a
    read that waited `READ_TIMEOUT_S`), first (set at the first frame or at the end), ended_s.
    """

    def __init__(
        self,
        http: httpx.Client,
        router_url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        go: threading.Event | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.http = http
        self.go = go
        self.url = f"{router_url}/v1/completions"
        self.body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.headers = headers
        self.status: int | None = None
        self.replica: str | None = None
        self.frames: list[str] = []
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.ended_s: float | None = None

    def run(self) -> None:
        if self.go is not None:
            self.go.wait(WAIT_S)
        try:
            with self.http.stream("POST", self.url, json=self.body, headers=self.headers) as resp:
                self.status = resp.status_code
                self.replica = resp.headers.get(REPLICA_HEADER)
                if resp.status_code != 200:
                    self.frames.append(resp.read().decode())
                    return
                for line in sse_lines(resp.iter_text()):
                    if line.startswith("data: "):
                        self.frames.append(line[len("data: ") :])
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc
        finally:
            self.ended_s = time.monotonic()
            self.first.set()

    def finished(self) -> bool:
        """It ended as a whole answer: status 200, no error event, usage, then [DONE]."""
        return (
            self.error is None
            and self.status == 200
            and self.frames[-1:] == ["[DONE]"]
            and self.error_code() is None
            and self.completion_tokens() == self.body["max_tokens"]
        )

    def error_code(self) -> str | None:
        """The code of the stream's error event, or None."""
        for frame in self.frames:
            if frame.startswith('{"error"'):
                return json.loads(frame)["error"]["code"]
        return None

    def completion_tokens(self) -> int | None:
        """The usage chunk's completion_tokens, or None."""
        for frame in self.frames:
            if frame != "[DONE]":
                usage = json.loads(frame).get("usage")
                if usage:
                    return usage["completion_tokens"]
        return None

    def describe(self) -> str:
        """What came back, for assertion messages."""
        return f"{self.replica} {self.status} {self.error!r} {self.frames[-2:]}"


def start_streams(
    http: httpx.Client,
    router_url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    count: int,
) -> list[StreamCall]:
    """`count` streams of `body` (each with its own prompt suffix), sent at once (their threads
    wait on one event); returns once every one has its first frame (or ended)."""
    go = threading.Event()
    streams = [
        StreamCall(http, router_url, {**body, "prompt": f"{body['prompt']} {i}"}, headers, go)
        for i in range(count)
    ]
    for stream in streams:
        stream.start()
    go.set()
    for stream in streams:
        assert stream.first.wait(WAIT_S), "a stream never started"
        assert stream.error is None and stream.status == 200, stream.describe()
    return streams


@dataclass
class LoadLoop:
    """`num_threads` clients, each sending non-streamed requests one after the other until
    `stop()`. `results`: (status, serving replica, send time, exception) of each request."""

    http: httpx.Client
    router_url: str
    body: dict[str, Any]
    headers: dict[str, str]
    num_threads: int = 3
    results: list[tuple[int | None, str | None, float, BaseException | None]] = field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(self.num_threads)
        ]

    def _run(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            body = {**self.body, "prompt": f"{self.body['prompt']} {index}.{n}"}
            sent_s = time.monotonic()
            status = replica = error = None
            try:
                response = complete(self.http, self.router_url, body, self.headers)
                status, replica = response.status_code, response.headers.get(REPLICA_HEADER)
            except BaseException as exc:  # noqa: BLE001 - checked by the test
                error = exc
            with self._lock:
                self.results.append((status, replica, sent_s, error))
            n += 1

    def __enter__(self) -> LoadLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sending and wait for the requests in flight."""
        self._stop.set()
        for thread in self._threads:
            thread.join(WAIT_S)

    def count(self) -> int:
        """Requests that have come back so far."""
        with self._lock:
            return len(self.results)
