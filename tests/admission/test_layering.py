"""Layer rule: admission and tenancy import no engine, server, runner, model or torch code."""

from __future__ import annotations

import subprocess
import sys

FORBIDDEN = ("torch", "fastapi", "sits.engine", "sits.server", "sits.runner", "sits.models")


def test_admission_and_tenancy_import_light() -> None:
    code = (
        "import sys\n"
        "import sits.admission, sits.tenancy, sits.cli.tenants\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m in {FORBIDDEN!r}"
        f" or any(m.startswith(p + '.') for p in {FORBIDDEN!r})]\n"
        "print(','.join(sorted(bad)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
