#!/usr/bin/env bash
# The measurements behind docs/benchmarks.md, one after another, then the report.
# Run on a quiet machine (`uptime` load average below 0.5) with nothing else running; with
# OMP_NUM_THREADS unset every engine uses all cores. `make peers` first for the vLLM rows.
# usage: benchmarks/run_all.sh [throughput] [serve] [latency] [nativedecode] [prefill] [kvquality] [scheduler] [memory]
#        (default: all)
# PREFIX=amx_ (or avx2_, ...) names the result files for a host other than the AVX-512 BF16 EPYC the
# unprefixed files come from; benchmarks/results/hosts.json maps file names to hosts. Run from a
# committed tree: a run from a tree with uncommitted changes is reported as not citable.
# Approximate times on 2 cores: throughput 40-60 min (hf ~25, vllm ~15 incl. start-up), serve ~60 min,
# latency 4 min, nativedecode 2 min, prefill 5 min, kvquality 3 min, scheduler 2 min, memory 10 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PB=.venv/bin/pagedllm
R=benchmarks/results
P=${PREFIX:-}
mkdir -p "$R"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(throughput serve latency nativedecode prefill kvquality scheduler memory)
uptime
for step in "${steps[@]}"; do
  case "$step" in
    throughput)
      $PB bench throughput --num-prompts 128 --input-len-range 32:512 --output-len-range 16:256 \
        --dtype float32,bfloat16 --compare hf,vllm --output-json "$R/${P}throughput.json" ;;
    serve)
      # Both servers on their default dtype, one after the other on the same workload, in one run.
      $PB bench serve --launch pagedllm,vllm --num-prompts 48 --input-len-range 32:512 --output-len-range 16:256 \
        --request-rate 0.5,1,2,inf --slo-ttft 5000 --slo-tpot 500 --output-json "$R/${P}serve.json" || true
      # The targets' rates again, 3 rounds in alternating order (about 22 min), and the server against
      # the offline engine, 5 rounds (about 6 min): medians that one run on a drifting host cannot give.
      $PB bench serve --launch pagedllm,vllm --num-prompts 48 --input-len-range 32:512 --output-len-range 16:256 \
        --request-rate 0.5,inf --repeat 3 --slo-ttft 5000 --slo-tpot 500 --output-json "$R/${P}serve-vllm-rounds.json" || true
      $PB bench serve --launch pagedllm --label 'pagedllm server vs offline engine' --offline-baseline --repeat 5 \
        --num-prompts 48 --input-len-range 32:512 --output-len-range 16:256 --request-rate inf \
        --output-json "$R/${P}serve-offline.json" || true ;;
    latency)
      $PB bench latency --input-len 32 --output-len 128 --num-iters 3 --dtype float32,bfloat16 \
        --compare llama.cpp --repeat 5 --output-json "$R/${P}latency.json" ;;
    nativedecode)
      .venv/bin/python benchmarks/bench_native_decode.py --out "$R/${P}native_decode.json" ;;
    prefill)
      $PB bench latency --input-len 7000 --output-len 2 --num-iters 1 --num-iters-warmup 0 --max-model-len 8192 \
        --dtype float32,bfloat16 --compare hf --output-json "$R/${P}prefill.json" ;;
    kvquality)
      .venv/bin/python benchmarks/kv_cache_dtype_quality.py --dtype bfloat16 --calculate-kv-scales \
        --output-json "$R/${P}kv_cache_dtype_quality.json" ;;
    scheduler)
      $PB bench scheduler --num-running 64,256,1024 --num-steps 200 --output-json "$R/${P}scheduler.json" ;;
    memory)
      $PB bench memory --block-sizes 8,16,32,64 --num-prompts 256 --num-kv-tokens 65536 --max-model-len 2048 \
        --output-json "$R/${P}memory.json" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
$PB bench report
