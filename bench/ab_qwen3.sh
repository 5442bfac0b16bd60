#!/usr/bin/env bash
# A/B of two source trees on one GPU, one after the other in one call: qwen3-30b-a3b (random
# weights, bf16) 256 x 512/128 offline and batch 1 (512/256) / batch 10 (2048/1024) latency.
# Usage (GPU machine): bash bench/ab_qwen3.sh DIR_A DIR_B   (each DIR holds a src/ tree, e.g.
#   mkdir -p .ab/before && git archive COMMIT src | tar -x -C .ab/before)
# Prints each tree's command lines and the sits rows of the three reports.
set -uo pipefail
for tree in "$@"; do
  export PYTHONPATH="$(cd "$tree" && pwd)/src"
  echo "=== $tree"
  for cmd in \
    "bench throughput --random-weights qwen3-30b-a3b --input-len 512 --output-len 128 --num-prompts 256 --max-num-batched-tokens 8192" \
    "bench latency --random-weights qwen3-30b-a3b --batch-size 1 --input-len 512 --output-len 256 --num-iters 3 --num-iters-warmup 1" \
    "bench latency --random-weights qwen3-30b-a3b --batch-size 10 --input-len 2048 --output-len 1024 --num-iters 1 --num-iters-warmup 1"; do
    echo "sits $cmd"
    # shellcheck disable=SC2086
    python3 -m sits.cli.main $cmd 2>&1 | grep -E "^\| (sits|TPOT|TTFT) "
  done
done
