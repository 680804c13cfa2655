#!/usr/bin/env bash
# The planner's printed output on a fixed set of cases, for diffing a refactor
# that must not change it: `bench/plan_golden.sh DIR` before and after, then
# `diff -r BEFORE AFTER`. Lines that carry a wall time are dropped.
set -euo pipefail
out=${1:?usage: bench/plan_golden.sh OUT_DIR}
mkdir -p "$out"
run() {  # NAME ARGS...
  local name=$1; shift
  meshlm "$@" 2>&1 | grep -vE ' in [0-9.]+ ?(s|ms)\b|searched .* in ' > "$out/$name.txt" || true
}
run dsv3-explain plan --model deepseek-v3 --gpu h100 --gpus 1024 --seq-len 4096 \
  --global-batch-tokens 15728640 --explain --top 25
run llama3-8b plan --model llama3-8b --gpu h100 --gpus 64
run llama3-70b plan --model llama3-70b --gpu h100 --gpus 64
run llama3-405b plan --model llama3-405b --gpu h100 --gpus 2048 --seq-len 8192
run mixtral plan --model mixtral-8x7b --gpu h100 --gpus 64
run moonlight-muon plan --model moonlight-16b-a3b --gpu h100 --gpus 64 --optim muon
run llama3-8b-muon plan --model llama3-8b --gpu h100 --gpus 16 --optim muon
run fix plan --model llama3-70b --gpu h100 --gpus 64 --fix tp=8 --fix zero=3
run mixed plan --model llama3-8b --gpu h100:8,a100-80gb:8
run islands plan --model llama3-8b --gpu h100 --gpus 64 --islands 2
run json plan --model llama3-8b --gpu a100 --gpus 16 --json
run estimate-70b estimate --config configs/llama3-70b-32xh100.toml --gpu h100 --gpus 32
run estimate-dsv3 estimate --config configs/deepseek-v3-1024xh100.toml --gpu h100 --gpus 1024 --json
