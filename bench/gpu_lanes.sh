#!/usr/bin/env bash
# Run gpu_check.sh sections on several GPUs of one machine at once, one lane per GPU, each lane
# cut at LANE_TIMEOUT seconds (default 560), then pack every log and JSON into $OUT/all-lanes.tgz
# (the device tool brings back at most 8 files). Prints each lane's table at the end.
# Usage: bash bench/gpu_lanes.sh "SECTIONS FOR GPU 0" "SECTIONS FOR GPU 1" ...
# A lane's leading NAME=VALUE words are environment for that lane only, e.g.
#   bash bench/gpu_lanes.sh "qos qos_fcfs" "QOS_SERVE_ARGS=--tpot-pacing-fraction=0.95 qos qos_fcfs"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_ROOT="${OUT:-/tmp/sits-gpu-lanes}"
mkdir -p "$OUT_ROOT"
gpu=0
for sections in "$@"; do
  lane="$OUT_ROOT/lane$gpu"; mkdir -p "$lane"
  lane_env=()
  read -ra words <<<"$sections"
  while ((${#words[@]})) && [[ ${words[0]} == [A-Za-z_]*=* ]]; do
    lane_env+=("${words[0]}"); words=("${words[@]:1}")
  done
  env "${lane_env[@]}" CUDA_VISIBLE_DEVICES=$gpu OUT="$lane" timeout "${LANE_TIMEOUT:-560}" \
    bash bench/gpu_check.sh "${words[@]}" >"$lane/console.txt" 2>&1 &
  gpu=$((gpu + 1))
done
wait
for ((i = 0; i < gpu; i++)); do
  echo "=== lane $i (GPU $i)"
  grep -A 100 '^| step |' "$OUT_ROOT/lane$i/console.txt" || tail -n 20 "$OUT_ROOT/lane$i/console.txt"
done
(cd "$OUT_ROOT" && tar czf all-lanes.tgz lane[0-9]* && rm -rf lane[0-9]*)
ls -l "$OUT_ROOT"
