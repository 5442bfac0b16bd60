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
# Headless Chromium and its driver (Debian's packages) for the dashboard's browser test
# (tests/server/test_dashboard.py); where apt-get is missing or we are not root, or the install
# fails, that one test is skipped.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
  && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  if ! { timeout 300 apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq \
      --no-install-recommends chromium chromium-driver; } >/dev/null 2>&1; then
    echo "warning: could not install chromium; the dashboard browser test will be skipped" >&2
  fi
fi
