"""The reliability suite (issue 30): real `sits serve` processes under storms, fuzzing, signals,
engine faults and a soak. Marked `reliability`, out of the default run; run by
scripts/reliability.sh.

Sizes come from RELIABILITY_SCALE: "small" (default, CI's budget) or "full" (the issue's
trial). Each test records its figures (requests sent, lost, 5xx, RSS growth) with the `figures`
fixture; at the end of the session they are printed and, when RELIABILITY_REPORT names a path,
written there as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.live import free_port, metric_samples, wait_healthy
from tests.waits import HANG_S, wait_until

SCALE = os.environ.get("RELIABILITY_SCALE", "small")
if SCALE not in ("small", "full"):
    raise ValueError(f"RELIABILITY_SCALE must be small or full, not {SCALE!r}")

# name -> (small, full): the trial sizes in "full".
_SIZES = {
    "storm_streams": (100, 500),
    "fuzz_requests": (300, 5000),
    "soak_s": (30, 600),
}
PROMPT = "def fibonacci(n):"
_FIGURES: dict[str, dict[str, Any]] = {}


def size(name: str) -> int:
    """This scale's size of `name` (a count, or seconds for `soak_s`)."""
    small, full = _SIZES[name]
    return small if SCALE == "small" else full


class Serve:
    """`python -m sits.cli.main serve MODEL ...` on a free loopback port, its log in a file.

    Args:
        model_dir: the checkpoint.
        log_path: where stdout and stderr go.
        extra: more `sits serve` arguments.
    """

    def __init__(self, model_dir: Path, log_path: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "sits.cli.main", "serve", str(model_dir),
            "--port", str(self.port),
            "--dtype", "float32",
            "--kv-cache-memory-bytes", str(16 << 20),
            "--log-level", "warning",
            *extra,
        ]  # fmt: skip
        if "--max-model-len" not in extra:
            cmd += ["--max-model-len", "1024"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SITS_API_KEY": ""}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def http(self, **kwargs: Any) -> httpx.Client:
        """A plain HTTP client for this server."""
        kwargs.setdefault("timeout", HANG_S)
        return httpx.Client(base_url=self.base_url, **kwargs)

    def health(self) -> httpx.Response:
        """GET /health."""
        return httpx.get(f"{self.base_url}/health", timeout=HANG_S)

    def gauges(self) -> tuple[float, float, float]:
        """(sits:kv_cache_usage_perc, sits:num_requests_running, sits:num_requests_waiting)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=HANG_S).text
        samples = metric_samples(text)
        names = ("sits:kv_cache_usage_perc", "sits:num_requests_running")
        names += ("sits:num_requests_waiting",)
        return tuple(samples[(name, ())] for name in names)  # type: ignore[return-value]

    def idle(self) -> bool:
        """No KV block in use, nothing running or waiting (per /metrics)."""
        return self.gauges() == (0.0, 0.0, 0.0)

    def rss_kib(self) -> int:
        """The server process's resident set (VmRSS of /proc/PID/status), KiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def engine_pid(self) -> int:
        """The pid of the `--engine-process` child (multiprocessing's spawned process).

        Raises:
            LookupError: no such child.
        """
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                return int(entry.name)
        raise LookupError("no engine process")

    def complete(self, max_tokens: int = 4) -> dict:
        """One greedy completion that must succeed; its JSON body."""
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
        resp = httpx.post(f"{self.base_url}/v1/completions", json=body, timeout=HANG_S)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == max_tokens
        return resp.json()

    def wait_until_idle(self) -> bool:
        """Wait (up to `HANG_S`) until `idle()`; its last value."""
        return wait_until(self.idle)

    def stop(self) -> None:
        """Kill the process if it still runs; close the log."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(HANG_S)
        self._log.close()


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """The tiny random Qwen3-MoE checkpoint of the server tests."""
    return tiny_model_factory("qwen3_moe")


@pytest.fixture
def serve(model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Serve]]:
    """`serve(*extra_args) -> Serve`, started and healthy; killed at the test's end."""
    started: list[Serve] = []

    def start(*extra: str) -> Serve:
        server = Serve(model_dir, tmp_path / f"serve{len(started)}.log", list(extra))
        started.append(server)
        wait_healthy(server.proc, server.base_url)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def shared_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """One server for the storm, the fuzzing and the soak (a start costs many seconds on a busy
    2-core machine): contexts of 128 tokens keep every fuzzed request short."""
    log_path = tmp_path_factory.mktemp("shared") / "serve.log"
    server = Serve(model_dir, log_path, ["--max-model-len", "128", "--max-num-seqs", "64"])
    try:
        wait_healthy(server.proc, server.base_url)
        yield server
    finally:
        server.stop()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    """This test's figures for the report (requests, lost, 5xx, rss_growth_kib, ...)."""
    return _FIGURES.setdefault(request.node.name, {})


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _FIGURES:
        return
    totals = {
        key: sum(f.get(key, 0) for f in _FIGURES.values()) for key in ("requests", "lost", "5xx")
    }
    report = {"scale": SCALE, "totals": totals, "tests": _FIGURES}
    path = os.environ.get("RELIABILITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(report, indent=2) + "\n")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    terminalreporter.section(f"reliability report (scale {SCALE})")
    for name, figs in _FIGURES.items():
        terminalreporter.write_line(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figs.items()))
