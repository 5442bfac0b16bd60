"""`sits serve` flags, the API key from the environment, and the demo model (built and served)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import sits.demo as demo
from sits.cli.serve import add_serve_parser, engine_config_kwargs, resolve_api_key
from sits.config import EngineConfig
from sits.core.errors import InvalidParameterError
from tests.server.live import free_port, wait_healthy
from tests.waits import HANG_S


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_map_to_the_engine_config() -> None:
    args = _parse(
        [
            "--model", "/m", "--host", "0.0.0.0", "--port", "9001",
            "--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "4",
            "--max-num-batched-tokens", "256", "--block-size", "32", "--dtype", "float32",
            "--kv-cache-memory-bytes", "1000000", "--gpu-memory-utilization", "0.5",
            "--seed", "7", "--no-enable-prefix-caching", "--shutdown-timeout", "2.5",
            "--tpot-pacing-fraction", "0.95", "--engine-step-timeout", "300",
        ]
    )  # fmt: skip
    assert args.engine_step_timeout == 300.0 and _parse([]).engine_step_timeout == 60.0
    config = EngineConfig(**engine_config_kwargs(args, args.model))
    assert (config.model, config.model_name, config.max_model_len) == ("/m", "tiny", 512)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (4, 256, 32)
    assert (config.dtype, config.kv_cache_memory_bytes, config.seed) == ("float32", 1000000, 7)
    assert config.gpu_memory_utilization == 0.5 and config.enable_prefix_caching is False
    assert config.tpot_pacing_fraction == 0.95
    assert EngineConfig(**engine_config_kwargs(_parse([]), "/m")).tpot_pacing_fraction == 0.9
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidParameterError) as err:
            EngineConfig(model="/m", tpot_pacing_fraction=bad)
        assert err.value.param == "tpot_pacing_fraction"
    assert (args.host, args.port, args.shutdown_timeout) == ("0.0.0.0", 9001, 2.5)
    defaults = _parse([])
    assert defaults.model is None and defaults.model_tag is None
    assert (defaults.host, defaults.port) == ("127.0.0.1", 8000)
    assert defaults.enable_prefix_caching is True
    assert _parse(["/some/ckpt"]).model_tag == "/some/ckpt"


@pytest.mark.parametrize(
    "argv",
    [["--port", "99999"], ["--port", "-1"], ["--port", "x"], ["--shutdown-timeout", "-1"],
     ["--shutdown-timeout", "nan"], ["--engine-step-timeout", "0"],
     ["--engine-step-timeout", "-1"], ["--engine-step-timeout", "inf"],
     ["--engine-step-timeout", "abc"]],
)  # fmt: skip
def test_bad_port_or_timeout_is_refused_before_any_model_work(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err
    if argv[0] == "--engine-step-timeout":
        assert f"must be a finite number of seconds > 0, got '{argv[1]}'" in err


def test_api_key_from_flag_or_environment() -> None:
    assert resolve_api_key(_parse([]), {}) is None
    assert resolve_api_key(_parse([]), {"SITS_API_KEY": "env-key"}) == "env-key"
    assert resolve_api_key(_parse(["--api-key", "flag"]), {"SITS_API_KEY": "env"}) == "flag"
    assert resolve_api_key(_parse([]), {"SITS_API_KEY": ""}) is None


@pytest.mark.parametrize(
    ("flag", "env", "resolve"),
    [
        ("api-key", "SITS_API_KEY", "resolve_api_key"),
        ("admin-key", "SITS_ADMIN_KEY", "resolve_admin_key"),
        ("router-key", "SITS_ROUTER_KEY", "resolve_router_key"),
    ],
)
def test_keys_from_a_file_stay_off_the_command_line(tmp_path, capsys, flag, env, resolve) -> None:
    """Each key flag has a --X-file twin (trailing newline stripped; before the environment;
    not with the flag), an unreadable file is a named error, and --help says the flag shows
    in `ps`."""
    from sits.cli import fleet_flags, serve

    fn = getattr(serve, resolve, None) or getattr(fleet_flags, resolve)
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    args = _parse([f"--{flag}-file", str(key_file)])
    assert fn(args, {env: "from-env"}) == "s3cret"
    key_file.write_text("")
    assert fn(args, {env: "from-env"}) is None  # an empty key means none, as before
    with pytest.raises(InvalidParameterError, match=f"cannot read --{flag}-file") as err:
        fn(_parse([f"--{flag}-file", str(tmp_path / "missing")]), {})
    assert err.value.param == f"{flag.replace('-', '_')}_file"
    with pytest.raises(SystemExit):
        _parse([f"--{flag}", "k", f"--{flag}-file", str(key_file)])
    assert "not allowed with argument" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    serve_parser = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    (action,) = [a for a in serve_parser._actions if f"--{flag}" in a.option_strings]
    assert f"prefer --{flag}-file or ${env}" in " ".join(action.help.split())


@pytest.fixture(scope="module")
def demo_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sits_cache"))


def test_random_demo_model_is_built_once_and_marked(demo_cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SITS_CACHE_DIR", demo_cache)
    monkeypatch.setattr(demo, "packaged_demo_dir", lambda: tmp_path / "no_packaged_model")
    path = demo.ensure_demo_model()
    assert path == os.path.join(demo_cache, "sits-demo-random")
    assert demo.is_random_demo(path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["vocab_size"], config["max_position_embeddings"]) == (4096, 2048)
    stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert demo.ensure_demo_model() == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    (packaged / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "packaged_demo_dir", lambda: packaged)
    assert demo.ensure_demo_model() == str(packaged) and not demo.is_random_demo(packaged)


def test_sits_serve_without_a_model_serves_the_demo(demo_cache, tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "SITS_CACHE_DIR": demo_cache, "OMP_NUM_THREADS": "1"}
    env["SITS_API_KEY"] = "demo-key"
    cmd = [sys.executable, "-m", "sits.cli.main", "serve", "--port", str(port)]
    cmd += ["--kv-cache-memory-bytes", str(16 << 20), "--log-level", "warning"]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    headers = {"Authorization": "Bearer demo-key"}
    try:
        wait_healthy(proc, base)
        assert httpx.get(f"{base}/v1/models").status_code == 401  # key from SITS_API_KEY
        card = httpx.get(f"{base}/v1/models", headers=headers).json()["data"][0]
        random_expected = not (demo.packaged_demo_dir() / "config.json").is_file()
        assert card["id"] == "sits-demo"
        assert card["random_weights"] is random_expected
        if random_expected:
            assert "RANDOM" in card["description"]
        body = {"model": "sits-demo", "prompt": "def fibonacci(n):", "max_tokens": 8}
        out = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=HANG_S)
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] <= 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def test_a_missing_event_loop_is_refused_before_the_model_loads(monkeypatch, capsys) -> None:
    """`--loop uvloop` without uvloop: exit 2 with the reason, and no engine is built."""
    from sits.cli.serve import run_serve
    from sits.server import http_impl

    monkeypatch.setattr(http_impl, "_installed", lambda module: False)
    monkeypatch.setattr(demo, "ensure_demo_model", lambda: pytest.fail("the model was loaded"))
    assert _parse(["--http", "h11", "--loop", "asyncio"]).loop == "asyncio"
    assert run_serve(_parse(["--loop", "uvloop"])) == 2
    assert "error: uvloop is not installed (pip install uvloop)" in capsys.readouterr().err


def test_pacing_min_prefill_tokens_flag_reaches_the_engine_config() -> None:
    args = _parse(["--tpot-pacing-min-prefill-tokens", "1536"])
    assert EngineConfig(**engine_config_kwargs(args, "/m")).tpot_pacing_min_prefill_tokens == 1536
    assert EngineConfig(model="/m").tpot_pacing_min_prefill_tokens == 0  # off by default
    for bad in (-1, 4096):  # the default max_num_batched_tokens is 2048
        with pytest.raises(InvalidParameterError, match="must be in \\[0, max_num_batched") as e:
            EngineConfig(model="/m", tpot_pacing_min_prefill_tokens=bad)
        assert e.value.param == "tpot_pacing_min_prefill_tokens"


def test_a_refused_engine_flag_is_named_as_argparse_names_its_own(capsys) -> None:
    from sits.cli.serve import run_serve

    model = str(Path(demo.__file__).parent / "demo_model")  # the checkpoint sits ships
    argv = ["--model", model, "--tpot-pacing-min-prefill-tokens", "-1", "--port", "0"]
    assert run_serve(_parse(argv)) == 2
    err = capsys.readouterr().err
    assert "error: argument --tpot-pacing-min-prefill-tokens: tpot_pacing_min_prefill_tokens" in err


@pytest.fixture
def busy_port():
    """A loopback port something listens on (as a server that runs already)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_busy_port_is_refused_before_the_model_loads(busy_port, monkeypatch, capsys) -> None:
    """A nonexistent model would fail too: the port's error must come first, and no engine is
    built (uvicorn's Errno 98 only after a long load was the bug)."""
    from sits.cli.serve import run_serve
    from sits.engine import async_llm

    monkeypatch.setattr(async_llm, "AsyncLLM", lambda *a, **k: pytest.fail("engine built"))
    monkeypatch.setattr(demo, "ensure_demo_model", lambda: pytest.fail("the model was loaded"))
    for model in (["--model", "/does/not/exist"], []):
        assert run_serve(_parse([*model, "--port", str(busy_port)])) == 2
        err = capsys.readouterr().err
        assert err == (
            f"error: port {busy_port} on 127.0.0.1 is in use: stop what listens there or choose "
            "another --port\n"
        )


def test_a_free_port_passes_the_check_and_stays_free() -> None:
    from sits.cli.serve import check_port_free

    port = free_port()
    check_port_free("127.0.0.1", port)
    with socket.socket() as sock:  # released: a server can listen there now
        sock.bind(("127.0.0.1", port))
        sock.listen()
        with pytest.raises(InvalidParameterError, match=f"port {port} on 127.0.0.1 is in use") as e:
            check_port_free("127.0.0.1", port)
        assert e.value.param == "port"
    with pytest.raises(InvalidParameterError, match="cannot resolve host 'no-such-host.invalid'"):
        check_port_free("no-such-host.invalid", port)


def test_sits_serve_on_a_busy_port_exits_2_with_the_reason(busy_port) -> None:
    cmd = [sys.executable, "-m", "sits.cli.main", "serve", "--model", "/does/not/exist"]
    proc = subprocess.run(
        [*cmd, "--port", str(busy_port)], capture_output=True, text=True, timeout=HANG_S
    )
    assert proc.returncode == 2
    assert f"error: port {busy_port} on 127.0.0.1 is in use" in proc.stderr
    assert "does/not/exist" not in proc.stderr  # no model work was tried
