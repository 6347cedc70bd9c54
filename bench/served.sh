#!/usr/bin/env bash
# Served speed on the GPU machine (bench/server_batching.py), MLX-CUDA staged in /tmp/site (../shared/gpu/prepare-mlx-cuda.sh).
#   bash bench/served.sh NAME [server_batching.py flags...]   -> $OUT/served-NAME.json (and .log)
# e.g. bash bench/served.sh h100-llama8b --synthetic-target llama-8b --clients 1,2,4,8 --duration 30 --max-tokens 256 --prompt-words 256
# An older commit's runtime served by this checkout's benchmark (SRC: its hooks, plugin and drafters, unpacked and
# carried as bench/versions_ab.sh's are; its modes must exist there, e.g. dflash):
#   rm -rf .old && mkdir .old && git archive REV hooks plugin drafters | tar -x -C .old
#   SRC=.old bash bench/served.sh NAME-old --modes dflash ...
set -uo pipefail
name="$1"; shift
out="${OUT:-./served-out}"; mkdir -p "$out"
src="$(cd "${SRC:-.}" && pwd)"
pkg="/tmp/served-$name"; rm -rf "$pkg"; mkdir -p "$pkg/mlx_speculative"  # the package's folders under its import name
for d in hooks plugin drafters demo benchmarks testing; do
  if [ -e "$src/$d" ]; then ln -sfn "$src/$d" "$pkg/mlx_speculative/$d"; else ln -sfn "$PWD/$d" "$pkg/mlx_speculative/$d"; fi
done
export PYTHONPATH="${SITE:-/tmp/site}:$pkg" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/served-$name.gpu.txt"
# the device's busy share every 100 ms (epoch, %): against each load's "window" in the JSON
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > "$out/served-$name.util.csv" 2>/dev/null &
mon=$!
python3 bench/server_batching.py "$@" --json "$out/served-$name.json" 2>&1 | tee "$out/served-$name.log"
kill "$mon" 2>/dev/null
