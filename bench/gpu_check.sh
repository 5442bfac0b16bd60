#!/usr/bin/env bash
# One call on the GPU machine: the gpu-marked tests (and the CPU tests of the kernels, compiled
# for the GPU), the kernel micro-benchmarks and the end-to-end benchmarks of issue 4; prints a
# short table at the end. Logs and JSON figures go to $OUT (or /tmp/sits-gpu-check).
# Usage (repo root, on the GPU machine): bash bench/gpu_check.sh [SECTION ...]
#   sections: tests micro e2e targets (default: tests micro e2e)
#   tests    all gpu-marked tests (kernels, sampling, models, layers, runner); the kernel
#            tests alone took 5.6 min serially (now on four pytest-xdist workers when the
#            image has xdist): give this section a lane of its own
#   micro    attention / quantized attention / MoE / norm+rotary / FP8 GEMM micro-benchmarks
#   e2e      short end-to-end runs: qwen3-30b-a3b throughput (no peer) and batch-1 latency
#   profile  kernel time breakdown of decode (batch 1/10/64) and a 2048-token prefill
#   decode   the issue-4 qwen3 figures without the peer (batch 10 2048/1024 and batch 1 TPOT,
#            256 x 512/128 offline) and the decode graphs' kernels at batch 1 and 10, context
#            2,560 (~4 min); with SITS_SRC=DIR in one lane, an A/B against another source tree
#   moe_tests  the GPU tests of the MoE routing, kernels, expert slots and spares and the GPU
#            runner (4.5 min serially; the kernel files now run on four pytest-xdist workers)
#   sweep    mixed steps as a paced server runs them (240 decodes at context 576 + chunks of
#            512), 768-2,048 tokens: replayed step us and each top kernel's us per size (~2 min)
#   moe_ab   the same sweep (1,024-2,048 tokens) with the shipped MoE configs and with those of
#            MOE_ALT_DIR (SITS_MOE_CONFIG_DIR); by default the shipped ones with the former
#            BLOCK_M 64 entry for 1,025-2,048 tokens of the qwen3 shape (~2 min)
#   targets  the issue-4 target workloads, with the transformers peer (~7 min); TARGET_FLAGS
#            adds engine flags to every run (e.g. --async-scheduling), also in `decode`
#   targets_qwen3  the same without the llama run (~4.5 min)
#   target_llama   the llama run alone (~3 min)
#   device_busy  the llama 1000 x 1000/1000 run (TARGET_FLAGS too) with each step's device time
#            bracketed by CUDA events and torch's sync debug mode on: device busy vs idle
#            seconds, busy ms per step kind, each place the host waited for the device (~2.5 min)
#   prefill_sweep  prefill attention launch parameters (attention_bench --sections sweep) on
#            the llama shape (8 x 1,000 new, as the 1000 x 1000/1000 run's chunks; 1 x 2,048;
#            2 x 1,000 cached + 1,000 new) and the qwen3 shape (16 x 512, 1 x 2,048) (~3 min)
#   profile_llama  llama-3.1-8b: SiLU-and-mul micro-benchmark at 1/256/8,192 tokens, kernels of
#            a batch-256 decode step (context 1,500) and of an 8,192-token mixed step (224
#            decodes + 1,000-token prompt chunks), as in the 1000 x 1000/1000 run (~2 min)
#   kv       the issue-7 targets: kv_ttft + kv_fp8 + kv_host (each also a section alone)
#   kv_ttft  prefix-cache TTFT (2,000-token shared prompt, 200 requests)
#   kv_ttft_eager  the same, both arrival patterns, with --no-mixed-step-cuda-graphs
#   kv_fp8   fp8 vs bf16 KV throughput, 1000 x 1000/1000 (~2 x 3-4 min); --max-num-seqs 1024
#            so that KV capacity, not the default 256 sequence slots, bounds the batch
#   kv_host  host tier vs recompute-only preemption (burst of 2x the GPU KV capacity)
#   qos      the issue-6 target's QoS half: guaranteed + 3x burstable flood (needs the
#            server's wheels: carry .whl, see bench/README.md); QOS_CAPACITY=C (req/s)
#            skips the capacity run and calibrates the rates from C; ENGINE_PROCESS=1 serves
#            with --engine-process; QOS_DURATION=S sends for S seconds (default: the mix's);
#            QOS_SERVE_ARGS adds server flags (both halves), QOS_BENCH_ARGS client flags
#            (default --client-procs=4: one client process lags behind a QoS flood)
#            STEP_SHAPES=1 records every step's shape of each half (steps-MODE.jsonl);
#            PROFILE_STEPS=START:COUNT profiles those steps of each half (profile-MODE.txt)
#            each half also logs the kernel's listen-queue drops and samples the accept
#            queues (listen-queue-MODE.txt: connections waiting for the server to accept)
#   qos_fcfs the same mix's FCFS half alone (run it in another lane beside qos; combine the
#            two JSONs with python3 bench/qos/combine.py)
#   replay   replays those recorded steps on the device alone, kernel by kernel
#            (bench/profile_step.py --replay), e.g. STEP_SHAPES=1 ... qos qos_fcfs replay
#   steps    step cost by shape (bench/step_costs.py): wall and runner ms of steps grouped by
#            decoding sequences and prefill tokens, 1024 x 512/128 offline FCFS, budgets 2048
#            and 8192 tokens (the data TPOT pacing works with)
#   paced    the same engine run at fixed step sizes, as pacing cuts steps (768 x 512/128,
#            FCFS then 768, 1024, 1152, 1280, 1536 tokens per step): output tok/s and the cost
#            of full-batch steps per size (~4 min)
#   mixed    mixed-step CUDA graphs (on by default): their GPU tests, then qwen3-30b-a3b
#            offline 256 x 512/128 and 2048-token TTFT without (--no-...) and with them
#   quant_kernels  the GPU and interpreter tests of the FP8 / INT4 kernels and their
#            micro-benchmarks (FP8 GEMM, fused FP8 MoE, w4a16 GEMM and MoE when present)
#   moe_fp8_tune  the fused FP8 MoE tuner for Qwen3-30B-A3B (its JSON lands in the tree, so later
#            sections use it, and in $OUT_DIR); MOE_TUNE_BUDGET_S bounds it (default 150)
#   precision_tests  the precision switch's GPU tests (engine and server; carry .whl)
#   fp8_tune the FP8 GEMM tuner (bench/kernels/fp8_gemm_tune.py); JSON configs to
#            $OUT_DIR/fp8_configs (FP8_TUNE_TOKENS: the token counts, default 1,16,64,256,1024,4096)
#   quant    issue-25 end-to-end figures, each quantized run beside bf16 in the same call:
#            qwen3-30b-a3b FP8 / INT4 batch 1 and batch 10 latency, 256 x 512/128 offline, and
#            llama-3.1-8b FP8 weights + fp8 KV 1000 x 1000/1000 (QUANT_SKIP_LLAMA=1 skips it)
#   gemv     the FP8 and INT4 weight-only GEMV kernels (decode): their tests compiled, the
#            FP8 / INT4 kernel tests whose dispatch they join, bench/kernels/fp8_gemv_bench.py
#            and int4_gemv_bench.py (config sweeps, vs the tiled kernels and bf16), then
#            qwen3-30b-a3b FP8 and INT4 batch-1 latency on GEMV_BEFORE_SRC (a tree without
#            them, if set: an A/B) and on this tree (~8 min)
#   quant_decode  issue-25 FP8 decode: the fused FP8 MoE's tests and micro-benchmark
#            (1-256 tokens), the FP8 GEMM tuner at M = 1 for the qwen3 shapes (per-row
#            scales; its entries merged into the shipped JSONs, also copied to $OUT_DIR), then
#            qwen3-30b-a3b FP8 batch 1 / batch 10 latency and 256 x 512/128 offline (~7 min)
#   fusion   issue-25 batch-1 decode fusion: router GEMV + routing in one launch (GPU tests,
#            micro-benchmark, batch-1 TPOT with async scheduling; see the section)
#   pdl      issue-25 programmatic dependent launch: GPU tests, batch-1 TPOT A/B (see the section)
#   loop     HTTP event-loop lag and client TTFT/ITL with the engine in a thread vs in its own
#            process (sits serve --engine-process), qwen3-30b-a3b shape (needs .whl too)
set -uo pipefail
cd "$(dirname "$0")/.."
# SITS_SRC: the package's source tree to run (default src/), e.g. an older commit's
# (`git archive COMMIT src | tar -x -C .ab`, carried) for an A/B in lanes
export PYTHONPATH="${SITS_SRC:-$PWD/src}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-/tmp/sits-gpu-check}"
mkdir -p "$OUT_DIR"
SECTIONS="${*:-tests micro e2e}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

status=()
run() {  # run NAME CMD...: run a step, keep its log, record its exit code and last line
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  status+=("$name|$rc|$((SECONDS - t0))s|$(grep -v '^\s*$' "$OUT_DIR/$name.log" | tail -n 1 | cut -c1-90)")
}
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
has kv && SECTIONS="$SECTIONS kv_ttft kv_fp8 kv_host"
sits() { python3 -m sits.cli.main "$@"; }

# Kernel tests spend most of their time compiling Triton kernels on the host: with pytest-xdist
# (in the device image) four workers share the GPU. Serially they took 5.6 min.
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 4 --dist loadfile)
if has tests; then
  run kernel_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "gpu or not gpu" \
    tests/kernels
  run model_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    tests/sampling tests/models tests/layers tests/runner tests/engine/test_gpu_runner.py \
    tests/engine/test_host_prefix_copy.py tests/engine/test_swap_copy.py \
    tests/engine/test_expert_spares_gpu.py
fi
# The issue-4 qwen3 latency targets, run by `decode` and `targets` under their own names.
qwen3_latency() {  # qwen3_latency PREFIX: batch 10 2048/1024 and batch 1 512/256
  run "$1_qwen3_b10" sits bench latency --random-weights qwen3-30b-a3b --batch-size 10 \
    --input-len 2048 --output-len 1024 --num-iters 1 --num-iters-warmup 1 ${TARGET_FLAGS:-} \
    --output-json "$OUT_DIR/$1_qwen3_b10.json"
  run "$1_qwen3_b1" sits bench latency --random-weights qwen3-30b-a3b --batch-size 1 \
    --input-len 512 --output-len 256 --num-iters 5 --num-iters-warmup 1 ${TARGET_FLAGS:-} \
    --output-json "$OUT_DIR/$1_qwen3_b1.json"
}
if has decode; then
  qwen3_latency decode
  run decode_qwen3_offline sits bench throughput --random-weights qwen3-30b-a3b \
    --input-len 512 --output-len 128 --num-prompts 256 --max-num-batched-tokens 8192 \
    ${TARGET_FLAGS:-} --output-json "$OUT_DIR/decode_qwen3_offline.json"
  run decode_profile python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
    --batch-sizes 1 10 --context 2560 --prefill-tokens 512 --top 24
fi
if has moe_tests; then
  run moe_kernel_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
    -m "gpu or not gpu" tests/kernels/test_moe_triton.py tests/kernels/test_moe_triton_gpu.py \
    tests/kernels/test_moe_routing_triton.py tests/kernels/test_moe_routing_triton_gpu.py
  run moe_tests python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    tests/layers/test_expert_slots_gpu.py tests/engine/test_expert_spares_gpu.py \
    tests/engine/test_gpu_runner.py
fi
if has steps; then
  for budget in 2048 8192; do
    run "step_costs_$budget" python3 bench/step_costs.py --random-weights qwen3-30b-a3b \
      --num-prompts 1024 --input-len 512 --output-len 128 --max-num-batched-tokens "$budget"
  done
fi
if has paced; then
  run step_costs_paced python3 bench/step_costs.py --random-weights qwen3-30b-a3b \
    --num-prompts 768 --input-len 512 --output-len 128 --token-bucket 128 --seq-bucket 32 \
    --paced-step-tokens 0,768,1024,1152,1280,1536
fi
if has device_busy; then
  run device_busy_llama python3 bench/device_busy.py --random-weights llama-3.1-8b \
    --num-prompts 1000 --input-len 1000 --output-len 1000 --max-num-batched-tokens 8192 \
    --sync-debug ${TARGET_FLAGS:-}
fi
if has prefill_sweep; then
  run prefill_sweep_llama python3 bench/kernels/attention_bench.py --sections sweep \
    --num-heads 32 --num-kv-heads 8 --sweep-decode-cases "" \
    --sweep-prefill-cases 8x0+1000,1x0+2048,2x1000+1000 --reps 10
  run prefill_sweep_qwen3 python3 bench/kernels/attention_bench.py --sections sweep \
    --num-heads 32 --num-kv-heads 4 --sweep-decode-cases "" \
    --sweep-prefill-cases 16x0+512,1x0+2048 --reps 10
fi
if has profile_llama; then
  run act_bench python3 bench/kernels/norm_rotary_bench.py --tokens 1,256,8192 \
    --hidden-size 4096 --num-heads 32 --num-kv-heads 8 --no-qk-norm
  run profile_llama_decode python3 bench/profile_step.py --random-weights llama-3.1-8b \
    --batch-sizes 256 --context 1500 --prefill-tokens 1000 --top 16
  run profile_llama_mixed python3 bench/profile_step.py --random-weights llama-3.1-8b \
    --mixed-tokens 8192 --mixed-decodes 224 --context 1500 --mixed-chunk 1000 --top 16
fi
if has profile; then
  run profile_qwen3 python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
    --batch-sizes 1 10 64 --prefill-tokens 2048
fi
if has sweep; then
  run mixed_sweep python3 bench/profile_step.py --random-weights qwen3-30b-a3b \
    --mixed-tokens 768 896 1024 1152 1280 1408 1536 1792 2048 --mixed-decodes 240 \
    --context 576 --top 24
fi
if has moe_ab; then
  alt="${MOE_ALT_DIR:-$OUT_DIR/moe_alt}"
  [[ -n ${MOE_ALT_DIR:-} ]] || python3 bench/kernels/moe_alt_config.py "$alt"
  for dir in src/sits/kernels/configs "$alt"; do
    run "moe_ab_$(basename "$dir")" env SITS_MOE_CONFIG_DIR="$dir" python3 bench/profile_step.py \
      --random-weights qwen3-30b-a3b --mixed-tokens 1024 1152 1280 1536 2048 \
      --mixed-decodes 240 --context 576 --top 8
  done
fi
if has micro; then
  run attention_bench python3 bench/kernels/attention_bench.py
  run attention_quant_bench python3 bench/kernels/attention_quant_bench.py
  run moe_bench python3 bench/kernels/moe_bench.py
  run norm_rotary_bench python3 bench/kernels/norm_rotary_bench.py
  run fp8_gemm_bench python3 bench/kernels/fp8_gemm_bench.py
  run moe_fp8_bench python3 bench/kernels/moe_fp8_bench.py
  run w4a16_bench python3 bench/kernels/w4a16_bench.py
fi
if has e2e; then
  run latency_qwen3_b1 sits bench latency --random-weights qwen3-30b-a3b --batch-size 1 \
    --input-len 512 --output-len 128 --output-json "$OUT_DIR/latency_qwen3_b1.json"
  run throughput_qwen3 sits bench throughput --random-weights qwen3-30b-a3b \
    --input-len 512 --output-len 128 --num-prompts 256 \
    --output-json "$OUT_DIR/throughput_qwen3.json"
fi
has targets && SECTIONS="$SECTIONS targets_qwen3 target_llama"
if has targets_qwen3; then
  run target_qwen3_offline sits bench throughput --random-weights qwen3-30b-a3b \
    --input-len 512 --output-len 128 --num-prompts 256 --max-num-batched-tokens 8192 \
    --peer transformers ${TARGET_FLAGS:-} --output-json "$OUT_DIR/target_qwen3_offline.json"
  qwen3_latency target
fi
if has target_llama; then
  run target_llama8b sits bench throughput --random-weights llama-3.1-8b \
    --input-len 1000 --output-len 1000 --num-prompts 1000 --max-num-batched-tokens 8192 \
    ${TARGET_FLAGS:-} --output-json "$OUT_DIR/target_llama8b.json"
fi

if has mixed; then
  run mixed_tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_gpu_runner.py \
    -k mixed
  for flag in --no-mixed-step-cuda-graphs --mixed-step-cuda-graphs; do
    name=${flag#--no-mixed-step-cuda-graphs}; name=${name:+_graphs}
    run "mixed_offline${name:-_eager}" sits bench throughput --random-weights qwen3-30b-a3b \
      --input-len 512 --output-len 128 --num-prompts 256 --max-num-batched-tokens 8192 $flag \
      --output-json "$OUT_DIR/mixed_offline${name:-_eager}.json"
    run "mixed_ttft${name:-_eager}" sits bench latency --random-weights qwen3-30b-a3b \
      --batch-size 1 --input-len 2048 --output-len 16 --num-iters 5 --num-iters-warmup 1 $flag \
      --output-json "$OUT_DIR/mixed_ttft${name:-_eager}.json"
  done
fi
if has kv_ttft; then
  run kv_prefix_ttft python3 bench/prefix_ttft.py --random-weights qwen3-30b-a3b \
    --prefix-len 2000 --suffix-len 100 --num-requests 200 --result-json "$OUT_DIR/kv_prefix.json"
fi
if has kv_ttft_eager; then
  run kv_prefix_ttft_eager python3 bench/prefix_ttft.py --random-weights qwen3-30b-a3b \
    --prefix-len 2000 --suffix-len 100 --num-requests 200 --arrival both \
    --no-mixed-step-cuda-graphs --result-json "$OUT_DIR/kv_prefix_eager.json"
fi
if has kv_fp8; then
  for kv in auto fp8; do
    run "kv_throughput_$kv" sits bench throughput --random-weights qwen3-30b-a3b \
      --input-len 1000 --output-len 1000 --num-prompts 1000 --max-num-batched-tokens 8192 \
      --max-num-seqs 1024 --kv-cache-dtype "$kv" --output-json "$OUT_DIR/kv_throughput_$kv.json"
  done
fi
if has kv_host; then
  shape_dir=$(python3 -c "from sits.bench.shapes import write_shape_dir as w; print(w('qwen3-30b-a3b'))")
  run kv_host_tier python3 bench/kv_tiers.py --model "$shape_dir" --load-format dummy \
    --dtype bfloat16 --kv-cache-memory-bytes 5153960755 --input-len 768 --output-len 256 \
    --result-json "$OUT_DIR/kv_tiers.json"
fi
if has qos || has qos_fcfs || has loop; then
  if ! python3 -c "import fastapi, uvicorn, pydantic, opentelemetry.sdk" 2>/dev/null; then
    # lanes (bench/gpu_lanes.sh) share /tmp/site: the first installs, the others wait on the
    # lock and then find it installed (two pips at once fail on each other's files)
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    lock=(); command -v flock >/dev/null && lock=(flock /tmp/site.lock)
    "${lock[@]}" bash -c 'python3 -c "import fastapi, uvicorn, pydantic, opentelemetry.sdk" \
      2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl'
  fi
  # Qwen3-30B-A3B shape with the demo tokenizer's vocabulary, so every token has text.
  qos_dir=$(python3 - <<'PY'
import json, os, shutil
from sits.bench.shapes import write_shape_dir
src, dst = write_shape_dir("qwen3-30b-a3b"), "/tmp/sits-qos-shape"
shutil.rmtree(dst, ignore_errors=True); shutil.copytree(src, dst)
cfg = json.load(open(os.path.join(dst, "config.json"))); cfg["vocab_size"] = 8192
json.dump(cfg, open(os.path.join(dst, "config.json"), "w")); print(dst)
PY
)
  serve_args="--load-format dummy --tokenizer src/sits/demo_model --dtype bfloat16"
fi
if has loop; then
  run loop_lag python3 bench/loop_lag.py --model "$qos_dir" --serve-args "$serve_args" \
    --num-prompts 1500 --input-len 512 --output-len 128 --request-rate 25 \
    --result-json "$OUT_DIR/loop_lag.json"
fi
if has qos || has qos_fcfs; then
  [[ -n "${ENGINE_PROCESS:-}" ]] && serve_args="$serve_args --engine-process"
  serve_args="$serve_args ${QOS_SERVE_ARGS:-}"
  if [[ -n "${QOS_CAPACITY:-}" ]]; then  # a capacity (req/s) measured before: no capacity run
    echo "{\"runs\": {\"fcfs\": {\"totals\": {\"request_throughput\": $QOS_CAPACITY}}}}" \
      >"$OUT_DIR/qos_capacity.json"
  else
    run qos_capacity sits bench qos --model "$qos_dir" --modes fcfs --serve-args "$serve_args" \
      --tenants-mix bench/qos/capacity.toml --ignore-eos --log-dir "$OUT_DIR/qos-logs" \
      --result-json "$OUT_DIR/qos_capacity.json"
  fi
  run qos_calibrate python3 bench/qos/calibrate.py "$OUT_DIR/qos_capacity.json" \
    bench/qos/mix.toml "$OUT_DIR/qos_mix.toml" ${QOS_DURATION:+--duration-s "$QOS_DURATION"}
  # the kernel's listen-queue drops (a request that waited there is late before the server
  # sees it): TcpExt counters before and after each half, with the limits that bound them
  echo "ulimit -n $(ulimit -n); somaxconn $(cat /proc/sys/net/core/somaxconn 2>/dev/null);" \
    "tcp_max_syn_backlog $(cat /proc/sys/net/ipv4/tcp_max_syn_backlog 2>/dev/null)"
  tcp_drops() {
    awk '/^TcpExt:/ { if (!seen) { split($0, name); seen = 1 } else { for (i = 2; i <= NF; i++)
      if (name[i] ~ /^(ListenOverflows|ListenDrops|TCPBacklogDrop|TCPReqQFullDrop)$/)
        printf "%s=%s ", name[i], $i } } END { print "" }' /proc/net/netstat 2>/dev/null
  }
  modes=()
  has qos && modes+=(qos)
  has qos_fcfs && modes+=(fcfs)
  for mode in "${modes[@]}"; do
    # STEP_SHAPES=1: the server records every step's shape, replayed below (section 'replay')
    [[ -n "${STEP_SHAPES:-}" ]] && export SITS_STEP_SHAPES_FILE="$OUT_DIR/steps-$mode.jsonl"
    # PROFILE_STEPS=START:COUNT: torch.profiler's table of those server steps (profile-MODE.txt)
    [[ -n "${PROFILE_STEPS:-}" ]] && export SITS_PROFILE_STEPS="$PROFILE_STEPS" \
      SITS_PROFILE_FILE="$OUT_DIR/profile-$mode.txt"
    echo "TCP drops before $mode: $(tcp_drops)"
    # accept-queue lengths through the half (all listening ports; the server's is in its log)
    python3 bench/qos/listen_queue.py --out "$OUT_DIR/listen-queue-$mode.txt" &
    sampler=$!
    run "qos_target_$mode" sits bench qos --model "$qos_dir" --tenants bench/qos/tenants.toml \
      --modes "$mode" --serve-args "$serve_args" --tenants-mix "$OUT_DIR/qos_mix.toml" \
      --ignore-eos --log-dir "$OUT_DIR/qos-logs" --result-json "$OUT_DIR/qos_$mode.json" \
      ${QOS_BENCH_ARGS---client-procs=4}
    kill -TERM "$sampler" && wait "$sampler"
    echo "TCP drops after $mode: $(tcp_drops)"
    unset SITS_STEP_SHAPES_FILE SITS_PROFILE_STEPS SITS_PROFILE_FILE
  done
fi
if has quant_kernels; then
  qk=(tests/kernels/test_fp8_gemm_triton.py tests/kernels/test_fp8_gemm_triton_gpu.py)
  for f in tests/kernels/test_moe_fp8_triton*.py tests/kernels/test_w4a16*.py \
    tests/kernels/test_moe_int4_triton*.py; do [[ -e $f ]] && qk+=("$f"); done
  run quant_kernel_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
    -m "gpu or not gpu" "${qk[@]}"
  run fp8_gemm_bench python3 bench/kernels/fp8_gemm_bench.py
  run moe_fp8_bench_block python3 bench/kernels/moe_fp8_bench.py --scales block
  run moe_fp8_bench_channel python3 bench/kernels/moe_fp8_bench.py --scales channel
  run w4a16_bench python3 bench/kernels/w4a16_bench.py
fi
if has moe_fp8_tune; then  # the fused FP8 MoE's configs for Qwen3-30B-A3B, into the tree
  run moe_fp8_tune python3 bench/kernels/moe_tune.py --shape qwen3 --dtype fp8_w8a8 \
    --time-budget-s "${MOE_TUNE_BUDGET_S:-150}"
  cp src/sits/kernels/configs/moe_*fp8_w8a8*.json "$OUT_DIR/" 2>/dev/null
fi
if has precision_tests; then  # the precision switch on the GPU (the server test needs .whl)
  run precision_tests python3 -m pytest -q -s -p no:cacheprovider -m gpu \
    tests/engine/test_precision_switch_gpu.py tests/server/test_precision_gpu.py
fi
if has fp8_tune; then
  run fp8_tune python3 bench/kernels/fp8_gemm_tune.py --out-dir "$OUT_DIR/fp8_configs" \
    --tokens "${FP8_TUNE_TOKENS:-1,16,64,256,1024,4096}"
fi
if has quant; then
  for q in bf16 fp8 int4; do
    qflag=(); [[ $q != bf16 ]] && qflag=(--quantization "$q")
    run "quant_qwen3_b1_$q" sits bench latency --random-weights qwen3-30b-a3b "${qflag[@]}" \
      --batch-size 1 --input-len 512 --output-len 256 --num-iters 3 --num-iters-warmup 1 \
      --output-json "$OUT_DIR/quant_qwen3_b1_$q.json"
    [[ $q == int4 ]] && continue
    run "quant_qwen3_b10_$q" sits bench latency --random-weights qwen3-30b-a3b "${qflag[@]}" \
      --batch-size 10 --input-len 2048 --output-len 1024 --num-iters 1 --num-iters-warmup 1 \
      --output-json "$OUT_DIR/quant_qwen3_b10_$q.json"
    run "quant_qwen3_offline_$q" sits bench throughput --random-weights qwen3-30b-a3b \
      "${qflag[@]}" --input-len 512 --output-len 128 --num-prompts 256 \
      --max-num-batched-tokens 8192 --output-json "$OUT_DIR/quant_qwen3_offline_$q.json"
  done
  if [[ -z "${QUANT_SKIP_LLAMA:-}" ]]; then
    run quant_llama_bf16 sits bench throughput --random-weights llama-3.1-8b \
      --input-len 1000 --output-len 1000 --num-prompts 1000 ${TARGET_FLAGS:-} \
      --output-json "$OUT_DIR/quant_llama_bf16.json"
    run quant_llama_fp8 sits bench throughput --random-weights llama-3.1-8b --quantization fp8 \
      --kv-cache-dtype fp8 --input-len 1000 --output-len 1000 --num-prompts 1000 \
      --max-num-seqs 1024 ${TARGET_FLAGS:-} --output-json "$OUT_DIR/quant_llama_fp8.json"
  fi
fi
if has quant_decode; then
  run quant_decode_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
    -m "gpu or not gpu" tests/kernels/test_moe_fp8_triton.py tests/kernels/test_moe_fp8_triton_gpu.py
  run moe_fp8_bench_decode python3 bench/kernels/moe_fp8_bench.py --scales channel \
    --token-counts 1,10,16,32,64,256
  run fp8_tune_m1 timeout 150 python3 bench/kernels/fp8_gemm_tune.py --tokens 1 \
    --shapes qwen3_30b_qkv,qwen3_30b_o --scales channel --out-dir "$OUT_DIR/fp8_m1"
  python3 - "$OUT_DIR/fp8_m1" <<'PY'
import json, pathlib, sys
for new in pathlib.Path(sys.argv[1]).glob("*.json"):
    shipped = pathlib.Path("src/sits/kernels/configs") / new.name
    entries = json.loads(shipped.read_text()) if shipped.exists() else {}
    entries.update(json.loads(new.read_text()))
    shipped.write_text(json.dumps(entries, indent=1) + "\n")
    print("merged", new.name, json.loads(new.read_text()))
PY
  for q in fp8; do
    run "qd_qwen3_b1_$q" sits bench latency --random-weights qwen3-30b-a3b --quantization "$q" \
      --batch-size 1 --input-len 512 --output-len 256 --num-iters 3 --num-iters-warmup 1 \
      --output-json "$OUT_DIR/qd_qwen3_b1_$q.json"
    run "qd_qwen3_b10_$q" sits bench latency --random-weights qwen3-30b-a3b --quantization "$q" \
      --batch-size 10 --input-len 2048 --output-len 1024 --num-iters 1 --num-iters-warmup 1 \
      --output-json "$OUT_DIR/qd_qwen3_b10_$q.json"
    run "qd_qwen3_offline_$q" sits bench throughput --random-weights qwen3-30b-a3b \
      --quantization "$q" --input-len 512 --output-len 128 --num-prompts 256 \
      --max-num-batched-tokens 8192 --output-json "$OUT_DIR/qd_qwen3_offline_$q.json"
  done
fi
if has gemv; then
  run gemv_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "gpu or not gpu" \
    tests/kernels/test_fp8_gemv_triton.py tests/kernels/test_int4_gemv_triton.py \
    tests/kernels/test_moe_int4_triton.py tests/kernels/test_w4a16_gemm_triton.py \
    tests/kernels/test_fp8_gemm_triton.py \
    tests/kernels/test_fp8_gemm_triton_gpu.py tests/kernels/test_moe_fp8_triton.py \
    tests/kernels/test_moe_fp8_triton_gpu.py
  run gemv_bench timeout "${GEMV_BENCH_S:-300}" python3 bench/kernels/fp8_gemv_bench.py ${GEMV_BENCH_ARGS:-}
  run int4_gemv_bench timeout "${GEMV_BENCH_S:-300}" python3 bench/kernels/int4_gemv_bench.py \
    ${INT4_GEMV_BENCH_ARGS:-}
  gemv_b1() {  # gemv_b1 NAME SRC [QUANT]: qwen3-30b-a3b batch 1 512/256 on source tree SRC
    PYTHONPATH="$2${PYTHONPATH#"${SITS_SRC:-$PWD/src}"}" run "$1" python3 -m sits.cli.main \
      bench latency --random-weights qwen3-30b-a3b --quantization "${3:-fp8}" --batch-size 1 \
      --input-len 512 --output-len 256 --num-iters 3 --num-iters-warmup 1 \
      --output-json "$OUT_DIR/$1.json"
  }
  [[ -n ${GEMV_BEFORE_SRC:-} ]] && gemv_b1 gemv_qwen3_b1_fp8_before "$GEMV_BEFORE_SRC"
  gemv_b1 gemv_qwen3_b1_fp8 "${SITS_SRC:-$PWD/src}"
  [[ -n ${GEMV_BEFORE_SRC:-} ]] && gemv_b1 gemv_qwen3_b1_int4_before "$GEMV_BEFORE_SRC" int4
  gemv_b1 gemv_qwen3_b1_int4 "${SITS_SRC:-$PWD/src}" int4
fi
# fusion: issue-25 batch-1 decode fusion (the router GEMV + routing in one launch): its GPU
# tests and the MoE engines' GPU tests (greedy vs transformers, graphs, spares), its
# micro-benchmark with a launch sweep, then qwen3-30b-a3b batch-1 TPOT with
# --async-scheduling: FP8 on FUSION_BEFORE_SRC (a tree without it, if set) and on this tree,
# INT4 and bf16 on this tree (~6 min)
if has fusion; then
  run fusion_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "gpu or not gpu" \
    tests/kernels/test_moe_routing_triton_gpu.py tests/kernels/test_fp8_gemv_triton.py \
    tests/engine/test_gpu_runner.py tests/engine/test_expert_spares_gpu.py
  run gate_route_bench python3 bench/kernels/gate_route_bench.py
  fusion_b1() {  # fusion_b1 NAME SRC [FLAGS...]: qwen3-30b-a3b batch 1 512/256, async
    local name=$1 src=$2; shift 2
    PYTHONPATH="$src${PYTHONPATH#"${SITS_SRC:-$PWD/src}"}" run "$name" python3 -m sits.cli.main \
      bench latency --random-weights qwen3-30b-a3b --batch-size 1 --input-len 512 \
      --output-len 256 --num-iters 3 --num-iters-warmup 1 --async-scheduling "$@" \
      --output-json "$OUT_DIR/$name.json"
  }
  [[ -n ${FUSION_BEFORE_SRC:-} ]] && fusion_b1 fusion_b1_fp8_before "$FUSION_BEFORE_SRC" \
    --quantization fp8
  fusion_b1 fusion_b1_fp8 "${SITS_SRC:-$PWD/src}" --quantization fp8
  fusion_b1 fusion_b1_int4 "${SITS_SRC:-$PWD/src}" --quantization int4
  fusion_b1 fusion_b1_bf16 "${SITS_SRC:-$PWD/src}"
fi
# pdl: programmatic dependent launch of the decode kernels (issue 25): its test and the GPU
# tests of the kernels it touches and of the GPU runner (graph replay equals eager, greedy
# tokens equal transformers), then qwen3-30b-a3b batch-1 TPOT with --async-scheduling, FP8 and
# INT4 (PDL_QUANTS), each on PDL_BEFORE_SRC (a tree without PDL, if set) and on this tree (~9 min)
if has pdl; then
  run pdl_tests python3 -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m "gpu or not gpu" \
    tests/kernels/test_pdl_triton.py tests/kernels/test_fp8_gemv_triton.py \
    tests/kernels/test_norm_rotary_triton_gpu.py tests/kernels/test_moe_routing_triton_gpu.py \
    tests/kernels/test_attention_triton_gpu.py tests/engine/test_gpu_runner.py \
    ${PDL_TESTS:-}
  pdl_b1() {  # pdl_b1 NAME SRC QUANT: qwen3-30b-a3b batch 1 512/256, async
    PYTHONPATH="$2${PYTHONPATH#"${SITS_SRC:-$PWD/src}"}" run "$1" python3 -m sits.cli.main \
      bench latency --random-weights qwen3-30b-a3b --batch-size 1 --input-len 512 \
      --output-len 256 --num-iters 3 --num-iters-warmup 1 --async-scheduling \
      ${3:+--quantization $3} --output-json "$OUT_DIR/$1.json"
  }
  for q in ${PDL_QUANTS:-fp8 int4}; do
    [[ $q == bf16 ]] && qq= || qq=$q
    [[ -n ${PDL_BEFORE_SRC:-} ]] && pdl_b1 "pdl_b1_${q}_before" "$PDL_BEFORE_SRC" "$qq"
    pdl_b1 "pdl_b1_$q" "${SITS_SRC:-$PWD/src}" "$qq"
  done
fi
# precision: the issue-25 switch under load (sits bench precision-switch, ~2 min each with the
# start): 128 x 256/1024 through AsyncLLM, 20 switches bf16 <-> fp8 (then int4) every 40
# steps; per switch the delay to the first step in the new set (target < 1 step), output
# tok/s per precision, failed requests (target 0; the exit code says)
if has precision; then
  for q in fp8 int4; do
    run "precision_switch_$q" sits bench precision-switch --random-weights qwen3-30b-a3b \
      --precision-switch "$q" --num-prompts 128 --input-len 256 --output-len 1024 \
      --num-switches 20 --switch-every-steps 40 ${TARGET_FLAGS:-} \
      --output-json "$OUT_DIR/precision_switch_$q.json"
  done
fi
if has replay; then
  shapes=("$OUT_DIR"/steps-*.jsonl)
  [[ -e ${shapes[0]} ]] && run replay_steps python3 bench/profile_step.py \
    --random-weights qwen3-30b-a3b --replay "${shapes[@]}" --replay-steps 40 --top 24
fi
echo
echo "| step | exit | time | last line |"
echo "|---|---|---|---|"
for row in "${status[@]}"; do
  IFS='|' read -r name rc t last <<<"$row"
  echo "| $name | $rc | $t | $last |"
done
