"""Layer rule: the router is HTTP only; it imports no torch, engine, runner, model or kernel code,
and the server never imports the router."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "sits.engine", "sits.runner", "sits.models", "sits.kernels", "sits.layers")


def _loaded(modules: str) -> list[str]:
    code = f"import sys\nimport {modules}\nprint(','.join(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().split(",")


def test_the_router_imports_no_engine_code() -> None:
    loaded = _loaded("sits.router.app, sits.cli.router")
    bad = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in FORBIDDEN)]
    assert bad == []


def test_the_server_does_not_import_the_router() -> None:
    loaded = _loaded("sits.server.app, sits.cli.serve")
    assert [m for m in loaded if m.startswith("sits.router")] == []
