#!/usr/bin/env bash
# Served speed on the GPU machine (bench/server_batching.py), MLX-CUDA staged in /tmp/site (../shared/gpu/prepare-mlx-cuda.sh).
#   bash bench/served.sh NAME [server_batching.py flags...]   -> $OUT/served-NAME.json (and .log)
# e.g. bash bench/served.sh h100-llama8b --synthetic-target llama-8b --clients 1,2,4,8 --duration 30 --max-tokens 256 --prompt-words 256
set -uo pipefail
name="$1"; shift
out="${OUT:-./served-out}"; mkdir -p "$out"
mkdir -p /tmp/new/mlx_speculative  # the package's folders under its import name (no install there)
for d in hooks plugin drafters demo benchmarks testing; do ln -sfn "$PWD/$d" "/tmp/new/mlx_speculative/$d"; done
export PYTHONPATH="${SITE:-/tmp/site}:/tmp/new" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/served-$name.gpu.txt"
python3 bench/server_batching.py "$@" --json "$out/served-$name.json" 2>&1 | tee "$out/served-$name.log"
