#!/usr/bin/env bash
# Installs sits (scripts/install.sh) and runs the lint and the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check src tests
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q -n 2 "$@"
