#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md, in the pieces one lent-device call can hold (≤ 10 min each).
#   bash bench/gpu_session.sh mfu       # CUDA sanity, matmul ceiling, llama3-1b with and without AC, profile
#   bash bench/gpu_session.sh sizes     # small and llama3-3b
#   bash bench/gpu_session.sh offload   # optimizer offload vs none, a model that fits only with offload
# Results go to $OUT (or ./gpu-out) as JSON plus a log.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
exec > >(tee -a "$OUT/log.txt") 2>&1

case "${1:-mfu}" in
mfu)
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY - <<'EOF'
import torch, time
print("torch", torch.__version__, torch.cuda.get_device_name())
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ b
torch.cuda.synchronize()
print(f"matmul ceiling: {20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s (bf16 8192^3)")
EOF
  timeout 100 $PY bench/gpu.py --presets debug --seq-len 256 --micro-batches 4 --warmup 2 --steps 3
  timeout 230 $PY bench/gpu.py --presets llama3-1b --ac none --micro-batches 8,4,2 --warmup 3 --steps 30 \
      --profile --out "$OUT/llama3-1b_ac-none.json"
  timeout 200 $PY bench/gpu.py --presets llama3-1b --ac selective --micro-batches 16,8 --warmup 3 --steps 30 \
      --out "$OUT/llama3-1b_ac-selective.json"
  ;;
sizes)
  timeout 120 $PY bench/gpu.py --presets llama3-1b --ac selective --micro-batches 16 --warmup 3 --steps 5 \
      --profile --out "$OUT/llama3-1b_profile.json"
  timeout 150 $PY bench/gpu.py --presets small --ac none --micro-batches 64,32 --warmup 3 --steps 30 \
      --out "$OUT/small.json"
  timeout 400 $PY bench/gpu.py --presets llama3-3b --ac selective --micro-batches 8,4,2,1 --warmup 3 --steps 30 \
      --out "$OUT/llama3-3b.json"
  ;;
offload)
  # llama3-8b cut to 18 blocks: ~5.0B parameters. 16 B/param of weights, grads and Adam state is ~80 GB,
  # more than an 80 GB H100 holds; offloading the optimizer leaves ~4 B/param on the GPU.
  timeout 560 $PY bench/gpu.py --presets "" --offload-compare llama3-8b --set model.n_layers=18 \
      --ac full --offload-micro-batch 1 --warmup 1 --steps 3 --out "$OUT/offload.json"
  ;;
checks)
  # The user's path on CUDA (CLI, default data, bf16 and fp16), the cost of offload where both fit,
  # and what compile buys.
  timeout 200 $PY bench/gpu.py --presets "" --sync-check
  timeout 120 $PY -m meshlm.cli train --run-dir /tmp/meshlm-cli --model.preset small --training.steps 40 \
      --training.precision bf16 --training.compile true --metrics.progress false
  timeout 120 $PY -m meshlm.cli train --run-dir /tmp/meshlm-fp16 --model.preset small --training.steps 40 \
      --training.precision fp16 --metrics.progress false
  tail -n 2 /tmp/meshlm-cli/metrics.jsonl /tmp/meshlm-fp16/metrics.jsonl
  timeout 200 $PY bench/gpu.py --presets "" --offload-compare llama3-1b --offload-micro-batch 16 --ac selective \
      --warmup 3 --steps 10 --out "$OUT/offload-1b.json"
  timeout 150 $PY bench/gpu.py --presets llama3-1b --no-compile --ac selective --micro-batches 16 --warmup 3 \
      --steps 10 --out "$OUT/llama3-1b_no-compile.json"
  ;;
esac
