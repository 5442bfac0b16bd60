"""`-tp` on the command line (issue 27): `sits generate -tp 2` prints one rank's greedy text,
joins its worker and exits without a resource tracker warning, `--help` of serve and generate
lists the flag, and what is refused at start (a size below 1, --engine-process,
--async-scheduling with load-aware expert placement, a size the heads or vocabulary do not
fit) prints one error line and exits 2, before any worker process starts.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from sits.cli.main import main
from tests.waits import HANG_S

ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "2097152"]


@pytest.fixture(autouse=True)
def _no_worker_left():
    yield
    left = [p for p in multiprocessing.active_children() if p.name.startswith("sits-tp-rank")]
    assert not left, f"workers left running: {left}"


def _generate(model_dir, tp: int, capsys) -> dict:
    argv = ["generate", "--model", str(model_dir), "-tp", str(tp), *ENGINE]
    argv += ["--prompt", "def fibonacci(n):", "--max-tokens", "8", "--json"]
    assert main(argv) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    return json.loads(line)


def test_generate_with_two_ranks_prints_one_ranks_greedy_text(tiny_model_factory, capsys):
    model_dir = tiny_model_factory("llama")
    want = _generate(model_dir, 1, capsys)
    got = _generate(model_dir, 2, capsys)  # its worker joined before main returned
    assert got == want
    assert len(want["token_ids"]) == 8 and want["finish_reason"] == "length"


def test_generate_with_two_ranks_exits_without_a_resource_warning(tiny_model_factory) -> None:
    """The process's whole exit, its resource tracker's included (the pipes close when the
    tracker exits too): no "leaked semaphore" warning (the worker's tqdm lock is unlinked)."""
    model_dir = tiny_model_factory("llama")
    argv = ["generate", "--model", str(model_dir), "-tp", "2", *ENGINE]
    argv += ["--prompt", "def fibonacci(n):", "--max-tokens", "2", "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "sits.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout.splitlines()[-1])["token_ids"]) == 2
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr, done.stderr


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_lists_the_tensor_parallel_flag(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    flags = "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp TENSOR_PARALLEL_SIZE"
    assert flags in " ".join(out.split())


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize(
    ("flags", "overrides", "message"),
    [
        (["-tp", "0"], {}, "--tensor-parallel-size: tensor_parallel_size must be >= 1, got 0"),
        (["-tp", "2", "--async-scheduling", "--enable-expert-parallel",
          "--expert-router-policy", "load-aware"], {},
         "argument --async-scheduling: async_scheduling is not supported with "
         "expert_router_policy 'load-aware'"),
        # 4 heads, 2 KV heads, vocabulary 513: 3 fits none, 2 all but the vocabulary
        (["-tp", "3"], {}, "tensor parallel size 3 does not divide"),
        (["-tp", "2"], {"vocab_size": 513}, "size 2 does not divide vocab_size (513)"),
    ],
)  # fmt: skip
def test_refused_at_start_with_one_line(
    tiny_model_factory, capsys, monkeypatch, command, flags, overrides, message
) -> None:
    def no_runner(*args, **kwargs):
        raise AssertionError("a tensor-parallel runner started")

    monkeypatch.setattr("sits.runner.tp_executor.TensorParallelRunner.__init__", no_runner)
    model_dir = tiny_model_factory("llama", **overrides)
    capsys.readouterr()  # the checkpoint writer's progress bar
    argv = [command, "--model", str(model_dir), *flags, *ENGINE]
    argv += ["--port", "0"] if command == "serve" else ["--prompt", "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith("error: ") and message in line, err


def test_serve_refuses_two_ranks_in_an_engine_process(tiny_model_factory, capsys) -> None:
    model_dir = tiny_model_factory("llama")
    capsys.readouterr()  # the checkpoint writer's progress bar
    argv = ["serve", "--model", str(model_dir), "-tp", "2", "--engine-process", "--port", "0"]
    assert main([*argv, *ENGINE]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line.startswith("error: argument --engine-process: ") and "tensor_parallel_size 2" in line
    )
