"""The server on `AsyncMPLLM` (`sits serve --engine-process`): same answers as on `AsyncLLM`,
admin calls reach the child, a killed child fails the stream and /health, the flag."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from sits.cli.serve import add_serve_parser
from sits.config import EngineConfig
from sits.server.context import ServerSettings
from tests.server.conftest import KV_CACHE_BYTES, MAX_MODEL_LEN
from tests.server.live import LiveServer, free_port, wait_healthy
from tests.waits import HANG_S

ADMIN_KEY = "admin-key"
PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Write a haiku about GPUs."}]


def _mp_engine(model_dir: Path) -> Callable[[], Any]:
    def make_engine() -> Any:
        from sits.engine.async_mp import AsyncMPLLM

        config = EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
        )
        return AsyncMPLLM(config)

    return make_engine


def _streamed_chat(client: Any, model: str) -> tuple[str, str | None]:
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_process_engine_serves_like_the_thread_engine(tiny_moe_dir, client, model_name) -> None:
    want = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    want_chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=16, temperature=0
    )
    settings = ServerSettings(admin_key=ADMIN_KEY)
    with LiveServer(_mp_engine(tiny_moe_dir), settings) as live:
        mp_client = live.client()
        got = mp_client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=12, temperature=0
        )
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.completion_tokens == want.usage.completion_tokens == 12
        text, finish = _streamed_chat(mp_client, model_name)
        assert (text, finish) == (
            want_chat.choices[0].message.content,
            want_chat.choices[0].finish_reason,
        )
        assert text
        with live.http(headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as http:
            assert http.get("/health").status_code == 200
            experts = http.get("/v1/admin/experts").json()
            assert [layer["layer"] for layer in experts["layers"]] == [0, 1]
            assert sum(experts["layers"][0]["num_tokens"]) > 0
            frozen = http.post("/v1/admin/experts/1/2/freeze").json()
            assert frozen["layers"][1]["frozen"][2] is True
            bad = http.post("/v1/admin/experts/7/0/freeze")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "layer"
            thawed = http.post("/v1/admin/experts/1/2/unfreeze").json()
            assert not any(thawed["layers"][1]["frozen"])
        engine = live.engine
    assert engine.transport.exitcode == 0  # the server's shutdown waited for the child's exit


def test_killed_engine_process_fails_the_stream_and_health(tiny_moe_dir) -> None:
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with LiveServer(_mp_engine(tiny_moe_dir)) as live, live.http() as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[len("data: ") :])["choices"]
            os.kill(live.engine.pid, signal.SIGKILL)
            events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        refused = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert refused.status_code == 503
        assert live.wait_until(lambda: live.fatal_codes == [1])


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_engine_process_flag_is_off_by_default() -> None:
    assert _parse([]).engine_process is False
    assert _parse(["--engine-process"]).engine_process is True


def test_sits_serve_engine_process_answers_and_exits_on_sigterm_to_its_group(
    tiny_moe_dir, tmp_path
) -> None:
    """SIGTERM to the whole process group (what `systemctl stop` and `kill -- -PGID` do) reaches
    the engine process too: it ignores it and the server drains and stops it (exit 0, no
    ERROR logged)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sits.cli.main", "serve", str(tiny_moe_dir), "--engine-process"]
    cmd += ["--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    cmd += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--log-level", "warning"]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        body = {"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
        out = httpx.post(f"{base}/v1/completions", json=body, timeout=HANG_S)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 6
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    assert "ERROR" not in (tmp_path / "serve.log").read_text()
