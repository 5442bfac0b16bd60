#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked tests (and the CPU tests of the kernels, compiled
# for the GPU), then the attention micro-benchmark; prints a short table at the end.
# Usage (repo root, on the GPU machine): bash bench/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-/tmp/sits-gpu-check}"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

status=()
run() {  # run NAME CMD...: run a step, keep its log, record its exit code
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  status+=("$name|$rc|$((SECONDS - t0))s|$(tail -n 1 "$OUT_DIR/$name.log" | cut -c1-70)")
}

run kernel_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/kernels
run sampling_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/sampling
if [ "${1:-}" != "--quick" ]; then
  run model_tests python3 -m pytest -q -p no:cacheprovider tests/models tests/layers
  run attention_bench python3 bench/kernels/attention_bench.py
fi

echo
echo "| step | exit | time | last line |"
echo "|---|---|---|---|"
for row in "${status[@]}"; do
  IFS='|' read -r name rc t last <<<"$row"
  echo "| $name | $rc | $t | $last |"
done
