"""What every Python script of bench/ shares: run a `sits.bench` module's `main` from a checkout.

The benchmarks live in the package (`sits.bench`); a script here is only the runnable name that
bench/README.md and gpu_check.sh use (`python bench/NAME.py [flags]`, the same as
`python -m sits.bench.MODULE [flags]`). Running a script puts this folder first on sys.path, so
the scripts import this module as `_checkout`; when sits is not installed, the checkout's `src/`
is made importable (so `sits bench serve`'s client runs on a machine that has just httpx).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path


def run_main(module: str) -> int:
    """Run `module.main(sys.argv[1:])` and return its exit code.

    Args:
        module: dotted name of a `sits.bench` module whose `main(argv)` returns an exit code.

    Raises:
        ImportError: the module (or sits itself, with no checkout `src/` to fall back on) is
            missing.
    """
    try:
        import sits  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    return importlib.import_module(module).main(sys.argv[1:])
