#!/usr/bin/env bash
# Quick start: install sits into .venv, start `sits serve` on the built-in demo model, send it
# one completion ("def fibonacci(n):", 64 tokens, temperature 0), print the JSON answer and
# its text, then stop the server (SIGTERM: it drains and exits 0).
#
# Works from a fresh clone: creates .venv with `python3 -m venv` if missing, installs PyTorch
# 2.13.0 first (the CPU wheel where pip has one at hand, as on our CI machines; elsewhere install
# it from the PyTorch CPU index first, see README), then sits itself (`pip install -e .`).
# No model download: the demo model ships with sits or is made locally on first use.
# Environment: PORT (default 8000, or a free port when 8000 is taken).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each install step prints one line, "[install] <step> ... done in N s"; pip's output goes to a
# log, printed only when the step fails.
PIP_LOG="$(mktemp -t sits-pip-XXXXXX.log)"
step() {  # step NAME COMMAND...: run COMMAND with its output in $PIP_LOG, timed on one line
  local name="$1" start=$SECONDS
  shift
  printf '[install] %s ... ' "$name"
  if "$@" >"$PIP_LOG" 2>&1; then
    echo "done in $((SECONDS - start)) s"
  else
    echo "FAILED after $((SECONDS - start)) s; its output:"
    cat "$PIP_LOG"
    exit 1
  fi
}
if [ ! -x .venv/bin/python ]; then
  step "creating .venv" python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  step "installing CPU PyTorch 2.13.0" pip install torch==2.13.0
fi
step "installing sits (pip install -e .)" pip install -e .
rm -f "$PIP_LOG"

PORT="${PORT:-8000}"
if ! python - "$PORT" <<'EOF'
import socket, sys
with socket.socket() as s:
    try:
        s.bind(("127.0.0.1", int(sys.argv[1])))
    except OSError:
        sys.exit(1)
EOF
then
  PORT="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi

LOG="$(mktemp -t sits-quickstart-XXXXXX.log)"
echo "== starting: sits serve --port $PORT   (log: $LOG)"
sits serve --port "$PORT" >"$LOG" 2>&1 &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT

python - "$PORT" "$SERVER_PID" "$LOG" <<'EOF'
import json, os, sys, time, urllib.error, urllib.request

port, pid, log = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
base = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300
while True:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            if resp.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("sits serve exited during startup:\n" + open(log).read())
    if time.monotonic() > deadline:
        sys.exit("sits serve did not become healthy in 300 s:\n" + open(log).read())
    time.sleep(0.2)
print("== server is healthy")

with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as resp:
    card = json.load(resp)["data"][0]
print(f"== model: {card['id']}" + (" (RANDOM weights: its text is noise)" if card.get("random_weights") else ""))

body = {"model": card["id"], "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}
print("== POST /v1/completions " + json.dumps(body))
request = urllib.request.Request(
    f"{base}/v1/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
)
with urllib.request.urlopen(request, timeout=120) as resp:
    answer = json.load(resp)
print(json.dumps(answer, indent=2, ensure_ascii=False))
print("== text:")
print(body["prompt"] + answer["choices"][0]["text"])
EOF

echo "== stopping the server"
stop_server
trap - EXIT
rm -f "$LOG"  # kept (and named above) when something failed
echo "== done"
