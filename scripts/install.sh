#!/usr/bin/env bash
# Creates .venv (if missing) and installs sits with CPU PyTorch 2.13.0 and the dev extras.
# torch 2.13.0 first (the CPU wheel on our machines, where pip finds it on disk; elsewhere install
# it from the PyTorch CPU index first, see README): with it installed, `torch>=2.11` in pyproject
# pulls nothing more.
# Each step prints one line, "[install] <step> ... done in N s"; pip's output goes to a log,
# printed only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG="$(mktemp -t sits-install-XXXXXX.log)"
exec 3>&2  # the terminal's stderr, for warnings from inside a step

# step NAME COMMAND...: run COMMAND with its output in $LOG (printed if it fails), timing it
# on one line.
step() {
  local name="$1" start=$SECONDS
  shift
  printf '[install] %s ... ' "$name"
  if "$@" >"$LOG" 2>&1; then
    echo "done in $((SECONDS - start)) s"
  else
    echo "FAILED after $((SECONDS - start)) s; its output:"
    cat "$LOG"
    exit 1
  fi
}

install_torch() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip install "torch>=2.11"
  else
    pip install torch==2.13.0
  fi
}

# Headless Chromium and its driver (Debian's packages) for the dashboard's browser test
# (tests/server/test_dashboard.py); where apt-get is missing or we are not root, or the install
# fails, that one test is skipped.
install_chromium() {
  if ! { timeout 300 apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq \
      --no-install-recommends chromium chromium-driver; }; then
    echo "warning: could not install chromium; the dashboard browser test will be skipped" >&3
  fi
}

if [ ! -x .venv/bin/python ]; then
  step "creating .venv" python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  step "installing PyTorch" install_torch
fi
step "installing sits with the dev extras (pip install -e .[dev])" pip install -e ".[dev]"
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
  && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  step "installing chromium for the browser test" install_chromium
fi
rm -f "$LOG"
