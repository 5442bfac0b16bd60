"""A loopback fleet for benchmarks: replicas and a `sits router` in front, as real processes.

`LoopbackProcess` runs one command in its own process group (so a `kill -9` or the final
clean-up reaches every process it started), logs to a file, and `start()` returns once its
health URL answers 200. `Fleet` starts N replicas, either paced fakes
(`python -m sits.testing.fake_replica`) or real `sits serve` processes (the command of
`sits.bench.server_proc`), then `sits router --replica URL ...` on them, and waits until the
router lists every replica as healthy with its models known (`GET /v1/router/replicas`, with a
router key made for the run), so the first measured request finds the whole fleet. Every
address is 127.0.0.1 on ports that were free a moment before; the processes run with the same
interpreter and `server_env` (this checkout's sits first on PYTHONPATH). `Fleet.close()` (also
on any failure of `start()`, and on leaving the `with` block) stops everything: SIGTERM to each
group, SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sits.bench.client import COMPLETIONS, build_body
from sits.bench.errors import BenchmarkError
from sits.bench.server_proc import free_port, serve_command, server_env
from sits.config import child_process_env

LOOPBACK = "127.0.0.1"
REPLICA_KINDS = ("fake", "sits")
_POLL_S = 0.1
_LOG_TAIL_CHARS = 3000


class LoopbackProcess:
    """One server process on loopback, in its own process group.

    Args:
        name: what it is, for messages ("replica 0", "router").
        command: its argv.
        health_url: `start()` waits until a GET of it answers 200.
        log_path: where its stdout and stderr go.
    """

    def __init__(self, name: str, command: Sequence[str], health_url: str, log_path: Path) -> None:
        self.name = name
        self.command = list(command)
        self.health_url = health_url
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def log_tail(self) -> str:
        """The end of its log (for error messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def launch(self) -> None:
        """Start the process (does not wait; see `wait_healthy`)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(child_process_env()),
                start_new_session=True,
            )

    def wait_healthy(self, deadline_s: float) -> None:
        """Wait until the health URL answers 200, by `deadline_s` (`time.monotonic()`).

        Raises:
            BenchmarkError: the process exited or was not healthy by the deadline.
        """
        wait_until(self, lambda: _get_ok(self.health_url), deadline_s, "healthy")

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL its whole process group at once (`kill -9`) and reap it."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM its process group, SIGKILL after `grace_s`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):  # children left behind, if any
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(30)
        return self.proc.returncode


def _get_ok(url: str, headers: dict[str, str] | None = None) -> httpx.Response | None:
    try:
        response = httpx.get(url, headers=headers, timeout=2.0)
    except httpx.HTTPError:
        return None
    return response if response.status_code == 200 else None


def wait_until(
    proc: LoopbackProcess, ready: Callable[[], object], deadline_s: float, what: str
) -> None:
    """Poll `ready()` until it returns something true, while `proc` runs.

    Raises:
        BenchmarkError: `proc` exited, or `deadline_s` (`time.monotonic()`) passed.
    """
    while True:
        if not proc.alive():
            code = proc.proc.returncode if proc.proc is not None else None
            raise BenchmarkError(
                f"{proc.name} exited with {code} before it was {what}; log {proc.log_path}:\n"
                f"{proc.log_tail()}"
            )
        if ready():
            return
        if time.monotonic() > deadline_s:
            raise BenchmarkError(
                f"{proc.name} not {what} in time; log {proc.log_path}:\n{proc.log_tail()}"
            )
        time.sleep(_POLL_S)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What the replicas are.

    Attributes:
        kind: "fake" (`sits.testing.fake_replica`, paced by the three figures below) or "sits"
            (`sits serve --model MODEL` plus `serve_args`).
        ttft_ms, itl_ms, output_len: the fake's pacing (see `FakeReplicaConfig`).
        model: the `sits serve` checkpoint (kind "sits").
        serve_args: extra `sits serve` flags (kind "sits").

    Raises:
        ValueError: an unknown kind.
    """

    kind: str = "fake"
    ttft_ms: float = 50.0
    itl_ms: float = 20.0
    output_len: int = 32
    model: str = ""
    serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in REPLICA_KINDS:
            raise ValueError(f"replica kind must be one of {REPLICA_KINDS}, got {self.kind!r}")

    def command(self, port: int) -> list[str]:
        """The replica's argv on 127.0.0.1:`port`."""
        if self.kind == "sits":
            return serve_command(self.model, port, self.serve_args)
        return [
            sys.executable,
            "-m",
            "sits.testing.fake_replica",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--ttft-ms",
            f"{self.ttft_ms:g}",
            "--itl-ms",
            f"{self.itl_ms:g}",
            "--output-len",
            str(self.output_len),
        ]


class Fleet:
    """N replicas and a router on loopback (see the module docstring; a context manager).

    Args:
        spec: the replicas.
        num_replicas: how many (>= 1).
        log_dir: where the processes' logs go (`replica-I.log`, `router.log`).
        router_args: extra `sits router` flags.
        startup_timeout_s: how long the whole start may take.
    """

    def __init__(
        self,
        spec: ReplicaSpec,
        num_replicas: int,
        log_dir: Path,
        router_args: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.router_key = secrets.token_hex(16)
        self.replicas: list[LoopbackProcess] = []
        for i in range(num_replicas):
            port = free_port()
            url = f"http://{LOOPBACK}:{port}"
            self.replicas.append(
                LoopbackProcess(
                    f"replica {i}",
                    spec.command(port),
                    url + "/health",
                    self.log_dir / f"replica-{i}.log",
                )
            )
        self.replica_urls = [p.health_url.removesuffix("/health") for p in self.replicas]
        port = free_port()
        self.router_url = f"http://{LOOPBACK}:{port}"
        command = [
            sys.executable,
            "-m",
            "sits.cli.main",
            "router",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--router-key",
            self.router_key,
            "--log-level",
            "warning",
        ]
        for url in self.replica_urls:
            command += ["--replica", url]
        self.router = LoopbackProcess(
            "router",
            [*command, *router_args],
            self.router_url + "/health",
            self.log_dir / "router.log",
        )

    def start(self) -> Fleet:
        """Start the replicas, then the router; return once the router routes to all of them.

        Raises:
            BenchmarkError: a process exited or was not ready within `startup_timeout_s` (every
                process started is stopped first).
        """
        deadline_s = time.monotonic() + self.startup_timeout_s
        try:
            for proc in self.replicas:
                proc.launch()
            for proc in self.replicas:
                proc.wait_healthy(deadline_s)
            self.router.launch()
            self.router.wait_healthy(deadline_s)
            wait_until(self.router, self._all_routable, deadline_s, "routing to every replica")
        except BaseException:
            self.close()
            raise
        return self

    def router_replicas(self) -> list[dict]:
        """The router's view of its replicas (`GET /v1/router/replicas`); [] when unreachable."""
        auth = {"Authorization": f"Bearer {self.router_key}"}
        response = _get_ok(self.router_url + "/v1/router/replicas", auth)
        return response.json().get("data", []) if response is not None else []

    def _all_routable(self) -> bool:
        seen = self.router_replicas()
        ready = {r["url"] for r in seen if r.get("status") == "healthy" and r.get("models")}
        return ready >= set(self.replica_urls)

    def model(self) -> str:
        """The model the fleet serves (the first of the router's `/v1/models`).

        Raises:
            BenchmarkError: the router lists no model.
        """
        response = _get_ok(self.router_url + "/v1/models")
        cards = response.json().get("data", []) if response is not None else []
        if not cards:
            raise BenchmarkError(f"the router lists no model; log {self.router.log_path}")
        return str(cards[0]["id"])

    def metrics_text(self) -> str:
        """The router's `/metrics` text ("" when unreachable)."""
        response = _get_ok(self.router_url + "/metrics")
        return response.text if response is not None else ""

    def close(self) -> None:
        """Stop the router, then every replica (each: SIGTERM, SIGKILL after a grace)."""
        self.router.stop()
        for proc in self.replicas:
            proc.stop()

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def request_body(model: str, index: int, output_len: int) -> dict[str, Any]:
    """The streamed completion request number `index` (a short prompt of its own)."""
    prompt = f"Request {index}: write a short story about a lighthouse."
    return build_body(COMPLETIONS, model, prompt, output_len, ignore_eos=True)


def router_counters(metrics_text: str) -> dict[str, dict[str, float]]:
    """The router's routing decisions by reason and retries by kind, from its `/metrics`."""
    wanted = {
        "sits:router_routing_decisions_total": ("decisions", "reason"),
        "sits:router_retries_total": ("retries", "kind"),
    }
    out: dict[str, dict[str, float]] = {"decisions": {}, "retries": {}}
    for line in metrics_text.splitlines():
        name, _, rest = line.partition("{")
        if name not in wanted or "}" not in rest:
            continue
        group, label = wanted[name]
        labels, _, value = rest.rpartition("}")
        for item in labels.split(","):
            key, _, quoted = item.partition("=")
            if key == label:
                out[group][quoted.strip('"')] = float(value)
    return out
