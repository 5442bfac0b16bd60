#!/usr/bin/env bash
# Creates .venv (if missing) and installs sits with CPU PyTorch 2.13.0 and the dev extras.
# torch 2.13.0 first (the CPU wheel on our machines, where pip finds it on disk; elsewhere install
# it from the PyTorch CPU index first, see README): with it installed, `torch>=2.11` in pyproject
# pulls nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install -q "torch>=2.11"
  else
    pip install -q torch==2.13.0
  fi
fi
pip install -q -e ".[dev]"
