"""Layering rule (DESIGN.md): sched and kvcache import no torch, runner, models or layers."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN_PREFIXES = ("torch", "sits.runner", "sits.models", "sits.layers", "sits.kernels")


def test_sched_and_kvcache_import_no_device_code() -> None:
    code = (
        "import json, sys;"
        "import sits.sched, sits.kvcache.block_pool, sits.kvcache.hashing, sits.kvcache.kv_manager;"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    modules = json.loads(out)
    assert "sits.sched.scheduler" in modules
    assert [m for m in modules if m.startswith(FORBIDDEN_PREFIXES)] == []


def test_sched_imports_no_tenancy_engine_server_or_admission() -> None:
    code = "import json, sys; import sits.sched; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    modules = json.loads(out)
    assert "sits.sched.tenants" in modules and "sits.sched.policy" in modules
    higher = ("sits.tenancy", "sits.engine", "sits.server", "sits.admission", "sits.runner")
    assert [m for m in modules if m.startswith(higher)] == []
