"""`sits serve -tp 2` on the CPU (issue 27): the same greedy answers as one rank, a clean
SIGTERM that leaves no worker behind, and a killed rank under load failing every open request
with 503 (OpenAI's error format) before the server exits 1.

The subprocess servers find their worker among their child processes (`/proc`, the spawned
`multiprocessing.spawn` child); the in-process one by its multiprocessing name, sits-tp-rank1.
Every server started here is stopped (killed if need be) in a finally.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.server.live import LiveServer, free_port, metric_samples, wait_healthy
from tests.waits import HANG_S, wait_until

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Write a haiku about GPUs."}]
LONG = 900  # tokens: a request still running when its rank is killed


@pytest.fixture(scope="module")
def llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


class _Serve:
    """`python -m sits.cli.main serve MODEL -tp N` on a free loopback port."""

    def __init__(self, model_dir: Path, tp: int, log_path: Path) -> None:
        self.base_url = f"http://127.0.0.1:{(port := free_port())}"
        cmd = [
            sys.executable, "-m", "sits.cli.main", "serve", str(model_dir),
            "-tp", str(tp),
            "--port", str(port),
            "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--log-level", "warning",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SITS_API_KEY": ""}
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(HANG_S)
        self._log.close()


def _children(pid: int) -> dict[int, str]:
    """The live child processes of `pid`: {pid: command line}."""
    out: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # it exited meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == pid and fields[0] not in "ZX":
            out[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return out


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def _worker_pid(children: dict[int, str]) -> int:
    """The tensor-parallel worker among a server's children: its one spawned process."""
    (pid,) = [p for p, cmd in children.items() if "spawn_main" in cmd]
    return pid


def _answers(http: httpx.Client, model: str) -> tuple:
    """Greedy completion and chat answers: (text, finish reason, completion tokens) each."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    completion = http.post("/v1/completions", json={**body, "ignore_eos": True})
    chat = http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 16, "temperature": 0},
    )
    assert completion.status_code == chat.status_code == 200, (completion.text, chat.text)
    c, m = completion.json(), chat.json()
    return (
        (
            c["choices"][0]["text"],
            c["choices"][0]["finish_reason"],
            c["usage"]["completion_tokens"],
        ),
        (m["choices"][0]["message"]["content"], m["choices"][0]["finish_reason"]),
    )


def test_tp2_serve_answers_as_tp1_and_sigterm_leaves_no_worker(
    llama_dir, engine_factory, tmp_path
) -> None:
    model = str(llama_dir)
    with LiveServer(engine_factory(llama_dir)) as live, live.http() as http:
        want = _answers(http, model)
    server = _Serve(llama_dir, 2, tmp_path / "serve.log")
    try:
        wait_healthy(server.proc, server.base_url)
        children = _children(server.proc.pid)
        worker = _worker_pid(children)
        with httpx.Client(base_url=server.base_url, timeout=HANG_S) as http:
            got = _answers(http, model)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(HANG_S) == 0
    finally:
        server.stop()
    assert got == want
    assert want[0][2] == 12 and want[0][0] and want[1][0]
    assert _alive(worker) is False
    assert wait_until(lambda: not any(_alive(pid) for pid in children)), children
    assert "ERROR" not in server.log_path.read_text()


class _Request(threading.Thread):
    """One long completion, plain or streamed, read to its end in a thread."""

    def __init__(self, base_url: str, model: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
        self.body["stream"] = stream
        self.status: int | None = None
        self.body_json: dict | None = None
        self.events: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(base_url=self.base_url, timeout=HANG_S) as http,
                http.stream("POST", "/v1/completions", json=self.body) as resp,
            ):
                self.status = resp.status_code
                if not self.body["stream"]:
                    self.body_json = json.loads(resp.read())
                    return
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            self.error = exc


def _running(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=HANG_S).text
    return metric_samples(text).get(("sits:num_requests_running", ()), 0.0)


def _start_load(base_url: str, model: str) -> list[_Request]:
    """Three plain and one streamed long request, returned once all four run."""
    requests = [_Request(base_url, model, stream) for stream in (False, False, False, True)]
    for request in requests:
        request.start()
    assert wait_until(lambda: _running(base_url) == len(requests) or any(
        r.error or not r.is_alive() for r in requests
    ))  # fmt: skip
    assert all(r.is_alive() for r in requests), [(r.status, r.error) for r in requests]
    return requests


def _assert_engine_dead(error: dict, about: str = "") -> None:
    """OpenAI's error object of a dead engine; its message contains `about`."""
    assert error["code"] == "engine_dead", error
    assert error["type"] == "service_unavailable_error"
    assert about in error["message"] and error["param"] is None


def _assert_failed_with_503(requests: list[_Request]) -> None:
    for request in requests:
        request.join(HANG_S)
        assert not request.is_alive() and request.error is None, request.error
        if request.body["stream"]:  # its 200 was sent: the error is its last event
            assert request.status == 200 and request.events[-1] == "[DONE]"
            assert len(request.events) < LONG
            _assert_engine_dead(json.loads(request.events[-2])["error"], "tensor parallel")
        else:
            assert request.status == 503, request.body_json
            _assert_engine_dead(request.body_json["error"], "tensor parallel")


def test_a_killed_rank_fails_open_requests_with_503_and_the_server_exits_1(
    llama_dir, tmp_path
) -> None:
    model = str(llama_dir)
    server = _Serve(llama_dir, 2, tmp_path / "serve.log")
    try:
        wait_healthy(server.proc, server.base_url)
        children = _children(server.proc.pid)
        worker = _worker_pid(children)
        requests = _start_load(server.base_url, model)
        os.kill(worker, signal.SIGKILL)
        _assert_failed_with_503(requests)
        try:  # a new request: 503 until the server closes its socket, then refused
            late = httpx.post(
                f"{server.base_url}/v1/completions",
                json={"model": model, "prompt": PROMPT, "max_tokens": 2},
                timeout=HANG_S,
            )
            assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
        except httpx.TransportError:
            pass
        assert server.proc.wait(HANG_S) == 1
    finally:
        server.stop()
    assert wait_until(lambda: not any(_alive(pid) for pid in children)), children


def test_in_process_a_killed_rank_refuses_new_requests_with_503(llama_dir, engine_factory) -> None:
    """The engine-death path with the server kept up (LiveServer): /health and every new
    request answer 503 engine_dead, and the server's exit code is 1."""
    model = str(llama_dir)
    live = LiveServer(engine_factory(llama_dir, tensor_parallel_size=2))
    try:
        with live, live.http() as http:
            (worker,) = [p for p in multiprocessing.active_children() if p.name == "sits-tp-rank1"]
            requests = _start_load(live.base_url, model)
            os.kill(worker.pid, signal.SIGKILL)
            _assert_failed_with_503(requests)
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            for path, body in (
                ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2}),
                ("/v1/chat/completions", {"model": model, "messages": MESSAGES}),
            ):
                refused = http.post(path, json=body)
                assert refused.status_code == 503, refused.text
                _assert_engine_dead(refused.json()["error"])
            assert live.wait_until(lambda: live.fatal_codes == [1])
    finally:
        left = [p for p in multiprocessing.active_children() if p.name.startswith("sits-tp")]
        for process in left:
            process.kill()
            process.join(HANG_S)
    assert not left, left
