#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md, in pieces that one lent-device call holds (each under 10 minutes:
# the `timeout`s of a piece add up to less than 570 s; tests/test_bench_session.py sums them). One piece per call:
#   bash bench/gpu_session.sh headline   # first on every lent GPU: the rows that matter most, < 8 minutes
#   bash bench/gpu_session.sh next       # then, as time allows: the piece whose last run is oldest (never first)
#   bash bench/gpu_session.sh overlap    # a GEMM alone and beside a paced NCCL-like copy kernel (8-32 CTAs)
#   bash bench/gpu_session.sh multirank  # two ranks on one GPU: dp2 ZeRO-3, tp2 + SP, pp2 vs one process
#   bash bench/gpu_session.sh mfu        # CUDA sanity, matmul ceilings, llama3-1b selective / no AC / seq 8192
#   bash bench/gpu_session.sh docmask    # llama3-1b with data.document_mask: no mask, SDPA mask, flex
#   bash bench/gpu_session.sh 3b         # llama3-3b selective mb 4, then the chunked loss at mb 8
#   bash bench/gpu_session.sh 3b-noac    # llama3-3b with the chunked loss and no AC
#   bash bench/gpu_session.sh fp8        # fp8 vs bf16 at llama3-1b and llama3-3b (tokens/s)
#   bash bench/gpu_session.sh fp8-loss   # fp8 vs bf16 at llama3-1b's widths, 200 steps, BPE (held-out loss within 1%)
#   bash bench/gpu_session.sh fp8-moe    # fp8 vs bf16 MoE: deepseek-moe-16b 4 blocks, dsv3-debug (tokens/s)
#   bash bench/gpu_session.sh moe        # deepseek-moe-16b cut to 4 blocks, with the top kernels
#   bash bench/gpu_session.sh peers-1b   # bench/gpu_peers.py at llama3-1b (meshlm's row and the ratios)
#   bash bench/gpu_session.sh peers-3b   # bench/gpu_peers.py at llama3-3b
#   bash bench/gpu_session.sh peers-3b-chunks   # the same, meshlm with the chunked loss at mb 8 or 4
#   bash bench/gpu_session.sh calibrate  # `meshlm train` with metrics.profile_step, `meshlm estimate --calibrate`
#   bash bench/gpu_session.sh kernels    # bench/kernels.py: attention per SDPA backend and flex, the validation
#                                        # rows' GEMMs, eager element-wise rates, each against the planner's
#   bash bench/gpu_session.sh cp-kernel  # bench/cp_kernel.py: an all-gather CP rank's attention, flex vs dense mask
#   bash bench/gpu_session.sh sizes | offload | checks | nocompile   # small, 8b offload, CLI paths, eager
#   bash bench/gpu_session.sh all        # every piece above in turn (a machine without the 10-minute limit)
# Results go to $OUT/<piece>/ (OUT defaults to ./gpu-out) as JSON plus $OUT/log.txt; each piece starts with
# the card, driver, clocks and power (<piece>/meta.json), so a row can be read at the clock it ran. Back
# here, `python bench/ledger.py ingest <that folder>` files them under bench/results/<date>-<card>/ and
# updates the ledger (bench/results/LEDGER.json, .md), and `python bench/ledger.py render` the docs.
# fp8 rows use bench/gpu.py --fp8-compare (bf16 at the largest micro-batch that fits, then fp8 on the same
# shapes and batches, with the tokens/s ratio and the loss gap); masking rows --document-mask and
# --attn-impl; the 3b rows --loss-chunks.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
exec > >(tee -a "$OUT/log.txt") 2>&1
GPU="$PY bench/gpu.py --warmup 3 --steps 30"

card() {
  echo "== $1 $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.draw,power.limit \
      --format=csv
  $PY bench/ledger.py meta "$1" --out "$O"  # $O/meta.json: what `bench/ledger.py ingest` files it under
}

piece() {
O="$OUT/$1"  # each piece's files in a folder of its own (bench/results/<date>-<card>/<piece>/)
mkdir -p "$O"
case "$1" in
headline)
  # the rows that matter most, highest value first, in < 8 minutes (bench/headline.py: the rows' own
  # timeouts add up to 470 s; tests/test_bench_session.py checks both)
  card headline
  timeout 480 $PY bench/headline.py --out "$O"
  ;;
overlap)
  # a bf16 GEMM alone and beside a paced copy kernel of 8-32 CTAs (NCCL-like): GPU.overlap_slowdown
  card overlap
  timeout 90 $PY bench/overlap.py --out "$O/overlap.json"
  ;;
multirank)
  # two ranks on the one GPU (gloo through host memory): dp2 ZeRO-3, tp2 + SP, pp2 against one process,
  # fp32 and bf16, and the preemption flag read one step late on CUDA
  card multirank
  timeout 300 $PY bench/multirank.py --out "$O/multirank.json"
  ;;
mfu)
  card mfu
  $PY - <<'EOF'
import torch, time
print("torch", torch.__version__, torch.cuda.get_device_name())
for n in (8192, 4096):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): a @ b
    torch.cuda.synchronize()
    print(f"matmul ceiling: {20 * 2 * n**3 / (time.perf_counter() - t) / 1e12:.0f} TFLOP/s (bf16 {n}^3)")
EOF
  timeout 170 $GPU --presets llama3-1b --ac selective --micro-batches 16,8 --profile \
      --out "$O/llama3-1b_selective.json"
  timeout 170 $GPU --presets llama3-1b --ac none --micro-batches 16,8 --out "$O/llama3-1b_ac-none.json"
  timeout 170 $GPU --presets llama3-1b --ac none --seq-len 8192 --micro-batches 4,2 \
      --out "$O/llama3-1b_seq8192.json"
  ;;
docmask)
  # goal: flex with the mask >= 0.95x the no-mask tokens/s
  card docmask
  timeout 170 $GPU --presets llama3-1b --ac selective --micro-batches 16,8 --out "$O/llama3-1b_nomask.json"
  timeout 180 $GPU --presets llama3-1b --ac selective --micro-batches 16,8 --document-mask --attn-impl sdpa \
      --out "$O/llama3-1b_docmask_sdpa.json"
  timeout 200 $GPU --presets llama3-1b --ac selective --micro-batches 16,8 --document-mask --attn-impl flex \
      --out "$O/llama3-1b_docmask_flex.json"
  ;;
3b)
  card 3b
  timeout 250 $GPU --presets llama3-3b --ac selective --micro-batches 4,2 --out "$O/llama3-3b_selective.json"
  timeout 300 $GPU --presets llama3-3b --ac selective --micro-batches 8,4 --loss-chunks 8 \
      --out "$O/llama3-3b_selective_chunks8.json"
  ;;
3b-noac)
  card 3b-noac
  timeout 280 $GPU --presets llama3-3b --ac none --micro-batches 4,2 --loss-chunks 8 \
      --out "$O/llama3-3b_ac-none_chunks8.json"
  timeout 280 $GPU --presets llama3-3b --ac selective --micro-batches 4 --loss-chunks 8 \
      --out "$O/llama3-3b_selective_mb4_chunks8.json"
  ;;
fp8)
  # goal: fp8 >= 1.2x bf16 at 3b; each pair on the same warm card, same shapes and batches
  card fp8
  timeout 250 $GPU --presets "" --fp8-compare llama3-1b --ac selective --micro-batches 16,8 \
      --out "$O/fp8-compare-llama3-1b.json"
  timeout 300 $GPU --presets "" --fp8-compare llama3-3b --ac selective --micro-batches 4 \
      --out "$O/fp8-compare-llama3-3b.json"
  ;;
fp8-loss)
  # goal: fp8 tensorwise and rowwise end within 1% of bf16's held-out loss (bf16's two seeds: the noise
  # floor). The CPU's parity script (docs/fp8.md, "Loss parity") at llama3-1b's widths: BPE tokens of the
  # embedded corpus, lr 3e-4 with warm-up, 200 steps of 8 x 2048 tokens, one run at a time on the card
  card fp8-loss
  timeout 560 $PY bench/fp8_parity.py --steps 200 --seq 2048 --batch 8 --parallel 1 --threads 8 \
      --eval-every 100 --eval-batches 8 --json "$O/fp8-parity-1b.json" --png "$O/fp8-parity-1b.png" \
      --set training.device=cuda training.compile=true model.dim=2048 model.n_layers=16 model.n_heads=32 \
      model.n_kv_heads=8 model.ffn_dim=8192 optim.warmup=20
  ;;
moe)
  # goal: >= 45% MFU; the profile shows what the optimizer and the gradient accumulation cost now
  card moe
  timeout 280 $GPU --presets deepseek-moe-16b --set model.n_layers=4 --ac selective --micro-batches 8,4 \
      --profile --out "$O/deepseek-moe-4blocks.json"
  timeout 250 $GPU --presets deepseek-moe-16b --set model.n_layers=4 --ac selective --micro-batches 8 \
      --set training.global_batch=32 --out "$O/deepseek-moe-4blocks_accum4.json"
  ;;
fp8-moe)
  # goal (issue #50): fp8 MoE (float8 grouped GEMMs, float8 dispatch where ep > 1) against bf16 MoE, each
  # pair on the same warm card, same shapes and batches: DeepSeek-MoE-16B's blocks and DeepSeek-V3's shape
  card fp8-moe
  timeout 280 $GPU --presets "" --fp8-compare deepseek-moe-16b --set model.n_layers=4 --ac selective \
      --micro-batches 8,4 --out "$O/fp8-compare-deepseek-moe-4blocks.json"
  timeout 200 $GPU --presets "" --fp8-compare dsv3-debug --ac none --micro-batches 16 \
      --out "$O/fp8-compare-dsv3-debug.json"
  ;;
peers-1b)
  card peers-1b
  timeout 560 $PY bench/gpu_peers.py --presets llama3-1b --micro-batches 16,8 --ac selective --warmup 3 \
      --steps 20 --out "$O/peers-llama3-1b.json"
  ;;
peers-3b)
  card peers-3b
  timeout 560 $PY bench/gpu_peers.py --presets llama3-3b --micro-batches 4,2 --ac selective --warmup 3 \
      --steps 15 --peers bf16,liger,float8 --out "$O/peers-llama3-3b.json"
  ;;
peers-3b-chunks)
  # meshlm at 3b with the chunked loss and the larger micro-batch it buys, against the best bf16 peer
  card peers-3b-chunks
  timeout 560 $PY bench/gpu_peers.py --presets llama3-3b --micro-batches 8,4 --ac selective --warmup 3 \
      --steps 15 --peers bf16 --meshlm-args "--loss-chunks 8" --out "$O/peers-llama3-3b-chunks.json"
  ;;
calibrate)
  # a real `meshlm train` run with one profiled step, then the planner calibrated from it: the same layout
  # (within 10% of the run's median step, and it fits) and another one on the same machine
  card calibrate
  RUN="$O/run-llama3-1b"
  rm -rf "$RUN"
  timeout 300 $PY -m meshlm.cli train --run-dir "$RUN" --model.preset llama3-1b --data.seq_len 2048 \
      --training.steps 12 --training.global_batch 16 --training.micro_batch 16 --training.precision bf16 \
      --training.ac selective --training.compile true --training.eval_every 0 --metrics.every 1 \
      --metrics.profile_step 8 --metrics.progress false --checkpoint.every 0
  ls -la "$RUN"
  timeout 60 $PY -m meshlm.cli estimate --calibrate "$RUN" --config "$RUN/config.toml" --gpus 1 --json \
      > "$O/estimate-calibrated-llama3-1b.json"
  timeout 60 $PY -m meshlm.cli estimate --calibrate "$RUN" --config "$RUN/config.toml" --gpus 1
  timeout 60 $PY -m meshlm.cli estimate --gpu h100 --config "$RUN/config.toml" --gpus 1
  timeout 60 $PY -m meshlm.cli estimate --calibrate "$RUN" --model.preset llama3-3b --data.seq_len 8192 \
      --training.global_batch 1 --training.micro_batch 1 --training.precision bf16 --training.ac selective \
      --gpus 1
  ;;
sizes)
  card sizes
  timeout 150 $GPU --presets small --ac none --micro-batches 64,32 --out "$O/small.json"
  timeout 400 $GPU --presets llama3-3b --ac selective --micro-batches 8,4,2,1 --out "$O/llama3-3b.json"
  ;;
offload)
  # llama3-8b cut to 18 blocks: ~5.0B parameters. 16 B/param of weights, grads and Adam state is ~80 GB,
  # more than an 80 GB H100 holds; offloading the optimizer leaves ~4 B/param on the GPU.
  card offload
  timeout 560 $PY bench/gpu.py --presets "" --offload-compare llama3-8b --set model.n_layers=18 \
      --ac full --offload-micro-batch 1 --warmup 1 --steps 3 --out "$O/offload.json"
  ;;
checks)
  # The user's path on CUDA (CLI, default data, bf16 and fp16), the cost of offload where both fit,
  # and what compile buys.
  card checks
  timeout 150 $PY bench/gpu.py --presets "" --sync-check
  timeout 100 $PY -m meshlm.cli train --run-dir /tmp/meshlm-cli --model.preset small --training.steps 40 \
      --training.precision bf16 --training.compile true --metrics.progress false
  timeout 100 $PY -m meshlm.cli train --run-dir /tmp/meshlm-fp16 --model.preset small --training.steps 40 \
      --training.precision fp16 --metrics.progress false
  tail -n 2 /tmp/meshlm-cli/metrics.jsonl /tmp/meshlm-fp16/metrics.jsonl
  timeout 200 $PY bench/gpu.py --presets "" --offload-compare llama3-1b --offload-micro-batch 16 --ac selective \
      --warmup 3 --steps 10 --out "$O/offload-1b.json"
  ;;
nocompile)
  card nocompile
  timeout 150 $PY bench/gpu.py --presets llama3-1b --no-compile --ac selective --micro-batches 16 --warmup 3 \
      --steps 10 --out "$O/llama3-1b_no-compile.json"
  ;;
kernels)
  # the rates the planner's validation misses name (docs/benchmarks.md, "The GPU rows still to measure"):
  # the script starts no case after --budget-s and rewrites its JSON after every case
  card kernels
  timeout 540 $PY bench/kernels.py --budget-s 420 --out "$O/kernels.json"
  ;;
cp-kernel)
  # one all-gather CP rank's attention at 32K-131K (flex BlockMask rows vs SDPA's dense rows mask), with
  # the planner's seconds and each kernel's peak memory; then flex's compiled backward on CUDA (test_flex)
  card cp-kernel
  timeout 340 $PY bench/cp_kernel.py --budget-s 260 --out "$O/cp_kernel.json"
  timeout 60 $PY bench/block_mask.py --device cuda
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_flex.py 2>&1 | tail -n 5
  ;;
next)
  # the piece whose last run in bench/results/LEDGER.json is oldest (never-run first)
  piece "$($PY bench/ledger.py next)"
  ;;
*)
  echo "gpu_session.sh: unknown piece '$1' (see the list at the top of this file)"
  return 2
  ;;
esac
}

PIECES="headline overlap multirank mfu docmask 3b 3b-noac fp8 fp8-loss fp8-moe moe peers-1b peers-3b peers-3b-chunks calibrate kernels cp-kernel"
if [ "${1:-mfu}" = all ]; then
  for p in $PIECES sizes offload checks nocompile; do piece "$p"; done
else
  piece "${1:-mfu}"
fi
