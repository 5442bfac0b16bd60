#!/usr/bin/env bash
# CPU time of sits' HTTP process per streamed output token (Linux: reads /proc/PID/stat).
# Serves the demo model with the engine in its own process (--engine-process), so the HTTP
# process does only the HTTP side: parsing, admission, detokenizing, SSE frames. A warm-up of
# 100 requests, then NUM_PROMPTS streamed requests of 32 prompt / 128 output tokens at most
# CONCURRENCY in flight; prints the client's report lines and the HTTP process's CPU
# microseconds per output token (its utime + stime over the measured run).
# Usage (repo root, in the venv): bash bench/http_cpu.sh [EXTRA SERVE FLAGS...]
#   PORT (8011), NUM_PROMPTS (800), CONCURRENCY (200) override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-8011}
num_prompts=${NUM_PROMPTS:-800}
concurrency=${CONCURRENCY:-200}
output_len=128
log=$(mktemp)
echo "Command: bash bench/http_cpu.sh $* (PORT=$port NUM_PROMPTS=$num_prompts CONCURRENCY=$concurrency)"
sits serve --model src/sits/demo_model --engine-process --max-num-seqs 256 --port "$port" \
  "$@" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -f "$log"' EXIT
for _ in $(seq 120); do
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
  sleep 1
done
bench() {  # bench NUM CONCURRENCY
  sits bench serve --base-url "http://127.0.0.1:$port" --input-len 32 --output-len $output_len \
    --num-prompts "$1" --max-concurrency "$2" --ignore-eos --no-gpu-info
}
ticks() { awk '{print $14 + $15}' "/proc/$server/stat"; }
bench 100 100 >/dev/null
before=$(ticks)
bench "$num_prompts" "$concurrency" | grep -E "Output token throughput|TTFT  |ITL  "
after=$(ticks)
hz=$(getconf CLK_TCK)
python3 -c "
ticks, hz, tokens = $after - $before, $hz, $num_prompts * $output_len
print(f'HTTP process CPU: {ticks / hz:.2f} s for {tokens} output tokens: '
      f'{ticks / hz / tokens * 1e6:.0f} us per token')"
