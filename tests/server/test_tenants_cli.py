"""`sits serve --tenants`: a malformed file exits 2 naming line and field; a good one serves
tenants end to end (auth, rate-limit headers, cache isolation, per-tenant metrics)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sits.cli.serve import EXIT_BAD_CONFIG, add_serve_parser, load_tenants_arg, run_serve
from sits.core.errors import InvalidParameterError
from sits.tenancy import TenantConfigError, hash_api_key
from tests.server.conftest import KV_CACHE_BYTES
from tests.server.live import free_port, metric_samples, wait_healthy
from tests.waits import HANG_S

GOOD = f"""
[[tenants]]
id = "payments"
api_key_sha256 = ["{hash_api_key("pay-key")}"]
tier = "guaranteed"
reserved_kv_fraction = 0.5
ttft_ms = 60000
requests_per_minute = 3
tokens_per_minute = 200000
max_concurrent = 4

[[tenants]]
id = "search"
api_key_sha256 = ["{hash_api_key("search-key")}"]
tier = "best_effort"
"""
BAD_TIER = """[[tenants]]
id = "payments"
api_key_sha256 = ["{}"]
tier = "gold"
"""


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_malformed_tenants_file_exits_2_naming_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD_TIER.format("a" * 64))
    cmd = [sys.executable, "-m", "sits.cli.main", "serve", "--tenants", str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == EXIT_BAD_CONFIG == 2
    assert f"{bad}:4: tenants[0] field 'tier': tier must be one of" in proc.stderr
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[tenants]]\nid = "x"\n\nrequests_per_minut = 5\n')
    with pytest.raises(TenantConfigError) as err:
        load_tenants_arg(str(unknown), None)
    assert (err.value.line, err.value.field) == (4, "requests_per_minut")
    assert "did you mean 'requests_per_minute'" in str(err.value)


def test_serve_lists_every_error_of_a_bad_tenants_file(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "two.toml"
    bad.write_text(
        BAD_TIER.format("a" * 64)
        + '\n[[tenants]]\nid = "b"\napi_key_sha256 = ["'
        + "b" * 64
        + '"]\nttft_ms = -5\n'
    )
    assert run_serve(_parse(["--tenants", str(bad)])) == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert f"{bad}:4: tenants[0] field 'tier'" in err
    assert "tenants[1] field 'ttft_ms'" in err and "finite number > 0, got -5" in err


def test_tenants_flags_and_their_conflict_with_an_api_key(tmp_path: Path, capsys) -> None:
    good = tmp_path / "tenants.toml"
    good.write_text(GOOD)
    args = _parse(["--tenants", str(good), "--enable-prompt-tokens-details"])
    assert args.tenants == str(good) and args.enable_prompt_tokens_details
    defaults = _parse([])
    assert defaults.tenants is None and not defaults.enable_prompt_tokens_details
    assert load_tenants_arg(None, "k") is None
    assert load_tenants_arg(str(good), None).ids == ("payments", "search")
    with pytest.raises(InvalidParameterError, match="exclude each other"):
        load_tenants_arg(str(good), "k")
    assert run_serve(_parse(["--tenants", str(good), "--api-key", "k"])) == EXIT_BAD_CONFIG
    assert "exclude each other" in capsys.readouterr().err


def test_sits_serve_with_tenants_end_to_end(tiny_moe_dir: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(GOOD)
    port = free_port()
    cmd = [sys.executable, "-m", "sits.cli.main", "serve", "--model", str(tiny_moe_dir)]
    cmd += ["--port", str(port), "--tenants", str(tenants), "--dtype", "float32"]
    cmd += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--max-model-len", "1024"]
    cmd += ["--enable-prompt-tokens-details", "--log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SITS_API_KEY", None)
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": [11 + i for i in range(40)], "max_tokens": 3}
    try:
        wait_healthy(proc, base)
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        pay = {"Authorization": "Bearer pay-key"}
        search = {"Authorization": "Bearer search-key"}
        first = httpx.post(f"{base}/v1/completions", json=body, headers=pay, timeout=HANG_S)
        again = httpx.post(f"{base}/v1/completions", json=body, headers=pay, timeout=HANG_S)
        other = httpx.post(f"{base}/v1/completions", json=body, headers=search, timeout=HANG_S)
        assert first.status_code == again.status_code == other.status_code == 200
        responses = (first, again, other)
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses]
        assert cached == [0, 32, 0]  # 2 full blocks of 16; never across tenants
        assert first.headers["x-ratelimit-limit-requests"] == "3"
        assert again.headers["x-ratelimit-remaining-requests"] == "1"  # refills 1 per 20 s
        assert again.headers["x-sits-overload-state"] == "green"
        assert "x-ratelimit-limit-requests" not in other.headers  # search has no limits
        samples = metric_samples(httpx.get(f"{base}/metrics").text)
        reserved = samples[("sits:tenant_kv_blocks_reserved", (("tenant", "payments"),))]
        total = samples[("sits:num_total_blocks", ())]
        assert reserved == total // 2
        ok = (("outcome", "ok"), ("tenant", "payments"))
        assert samples[("sits:tenant_requests_total", ok)] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
