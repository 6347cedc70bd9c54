#!/usr/bin/env bash
# The H200 runs behind issue 19's acceptance: the short-query attention kernel (plugin/cuda_attention.py)
# wired into decoding through the dispatcher (plugin/attention.py), on and off. Prepared on the CPU; not run yet.
#
# Run from the repo root on the GPU machine with MLX-CUDA staged (../shared/gpu/prepare-mlx-cuda.sh puts it
# in $SITE, default /tmp/site). Each line below fits one device call (<= 10 minutes). Usage:
#   bash bench/h200_attention.sh check               # the kernel against MLX's SDPA (bench/gpu_attention_check.py)
#   bash bench/h200_attention.sh forwards            # bare forwards by positions 1..32 at 4k/16k keys, kernel on/off,
#                                                    #   padded cache (the plugin's) and KVCache; DFlash-shape block
#   bash bench/h200_attention.sh forwards-4bit       # the same with the target quantized (4 bits, group 64)
#   bash bench/h200_attention.sh e2e 512 2048        # mlx-spec bench at prompts near 512 and 2048, kernel on then off,
#                                                    #   3 runs each (oracle tau 6.5 and tau 1 adaptive, block 16)
#   bash bench/h200_attention.sh e2e 8192            # one call per long length: 8192, then 16384
#   bash bench/h200_attention.sh e2e-4bit 2048 8192  # the bench with the 4-bit target, kernel on then off, 1 run each
#   RUNS=1 bash bench/h200_attention.sh e2e 16384    # fewer runs where a call would run out of time
# Results go to $OUT (the device tool's output folder) or ./h200-out, named h200-attention-*.json; copy them to
# bench/results/kernels/ (forwards, check) and bench/results/attention/ (e2e) and regenerate bench/README.md.
set -euo pipefail
OUT=${OUT:-h200-out}
SITE=${SITE:-/tmp/site}
RUNS=${RUNS:-3}
mkdir -p "$OUT" /tmp/new/mlx_speculative
for d in hooks plugin drafters; do ln -sfn "$PWD/$d" "/tmp/new/mlx_speculative/$d"; done
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
py() { env PYTHONPATH="$SITE:/tmp/new" python3 "$@"; }
py -c "import mlx.core as mx; assert mx.cuda.is_available(), 'MLX-CUDA is not staged'; print(mx.__version__, mx.device_info().get('device_name'))"

FORWARDS=(bench/attention_forwards.py --synthetic-target llama-8b --keys 4096,16384 --widths 1,2,4,8,16,32
          --block 16 --dflash-layers 5 --iters 10 --kernel both)
BENCH=(-m mlx_speculative.plugin.bench --synthetic-target llama-8b --kind dflash --oracle-acceptance 6.5
       --adaptive-at 1 --block-sizes 16 --max-tokens 256 --no-mlx-lm-spec)
what=${1:-}; shift || true
case "$what" in
  check)
    py bench/gpu_attention_check.py --out "$OUT/h200-attention-kernel-check.json" | tail -20 ;;
  forwards)
    py "${FORWARDS[@]}" --cache padded --json "$OUT/h200-attention-forwards-padded.json"
    py "${FORWARDS[@]}" --cache kvcache --block 0 --json "$OUT/h200-attention-forwards-kvcache.json" ;;
  forwards-4bit)
    py "${FORWARDS[@]}" --cache padded --quantize-target 4 --json "$OUT/h200-attention-forwards-padded-4bit.json" ;;
  e2e)
    for L in "$@"; do
      for i in $(seq 1 "$RUNS"); do
        for k in on off; do
          py "${BENCH[@]}" --prompt-lengths "$L" --kernel $k --json "$OUT/h200-attention-e2e-$L-kernel-$k-$i.json" | tail -14
        done
      done
    done ;;
  e2e-4bit)
    for L in "$@"; do
      for k in on off; do
        py "${BENCH[@]}" --prompt-lengths "$L" --quantize-target 4 --kernel $k \
          --json "$OUT/h200-attention-e2e-4bit-$L-kernel-$k.json" | tail -14
      done
    done ;;
  *) echo "unknown: '$what' (check | forwards | forwards-4bit | e2e L.. | e2e-4bit L..)"; exit 2 ;;
esac
