"""A `vllm serve`-style command line run by `sits serve` unchanged: HTTPS (--ssl-keyfile,
--ssl-certfile), several --served-model-name, --trust-remote-code, --uvicorn-log-level,
--enable-log-requests, --generation-config, --dtype half, --kv-cache-dtype fp8_e4m3 and
--swap-space, on the demo model in a real process."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys

import httpx
import pytest

from tests.server.live import free_port
from tests.waits import HANG_S, wait_until

trustme = pytest.importorskip("trustme")


def test_a_vllm_command_line_serves_https(tmp_path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file, ca_file = tmp_path / "key.pem", tmp_path / "cert.pem", tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    port = free_port()
    cmd = [sys.executable, "-m", "sits.cli.main", "serve", "--port", str(port)]
    cmd += ["--ssl-keyfile", str(key_file), "--ssl-certfile", str(cert_file)]
    cmd += ["--served-model-name", "demo-a", "demo-b", "--trust-remote-code"]
    cmd += ["--uvicorn-log-level", "warning", "--log-level", "info", "--enable-log-requests"]
    cmd += ["--generation-config", "auto", "--dtype", "half", "--kv-cache-dtype", "fp8_e4m3"]
    cmd += ["--swap-space", "0.01", "--max-model-len", "256", "--kv-cache-memory-bytes"]
    cmd += [str(16 << 20), "--disable-log-requests", "--enable-chunked-prefill"]
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"https://127.0.0.1:{port}"
    try:
        verify = ssl.create_default_context(cafile=str(ca_file))
        with httpx.Client(base_url=base, verify=verify, timeout=HANG_S) as http:

            def healthy() -> bool:
                assert proc.poll() is None, log_path.read_text()
                try:
                    return http.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            assert wait_until(healthy), log_path.read_text()
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["demo-a", "demo-b"]
            body = {"model": "demo-b", "prompt": "def f(x):", "max_tokens": 4}
            out = http.post("/v1/completions", json=body).json()
            assert out["model"] == "demo-a" and out["usage"]["completion_tokens"] <= 4
            with pytest.raises(httpx.RemoteProtocolError):  # HTTPS only: plain HTTP gets no answer
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text()
    assert "sits runs no code from a checkpoint" in text
    assert "Uvicorn running on" not in text  # uvicorn at warning, sits at info
    assert "(float16" in text and "KV cache dtype fp8" in text  # --dtype half, fp8_e4m3
    assert "received request" not in text  # --disable-log-requests wins
