#!/usr/bin/env bash
# `mlx-spec bench` of this checkout against an older commit's on one GPU machine, whole runs alternating
# (old, new, old, new, ...), then their tok/s side by side (bench/versions_ab.py). MLX-CUDA staged in /tmp/site
# (../shared/gpu/prepare-mlx-cuda.sh); the older code unpacked beforehand on this machine and carried to the
# device (git-ignored):  rm -rf .old && mkdir .old && git archive REV hooks plugin drafters | tar -x -C .old
#   bash bench/versions_ab.sh NAME PAIRS [bench flags...]   -> $OUT/versions-NAME-{old,new}-N.json, -summary.json
# e.g. bash bench/versions_ab.sh h100-arch 1 --synthetic-target llama-8b --kind dflash --oracle-acceptance 6.5 \
#        --block-sizes 16 --prompt-lengths 1024 --max-tokens 256 --no-mlx-lm-spec
set -euo pipefail
name=$1; pairs=$2; shift 2
out="${OUT:-./versions-out}"; mkdir -p "$out" /tmp/new/mlx_speculative /tmp/old/mlx_speculative
for d in hooks plugin drafters demo benchmarks testing; do ln -sfn "$PWD/$d" "/tmp/new/mlx_speculative/$d"; done
for d in hooks plugin drafters; do ln -sfn "$PWD/.old/$d" "/tmp/old/mlx_speculative/$d"; done
# The bench's module: mlx_speculative.benchmarks now, mlx_speculative.plugin.bench before the architecture step.
old_module=mlx_speculative.benchmarks; [ -e .old/plugin/bench/__main__.py ] && old_module=mlx_speculative.plugin.bench
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
site="${SITE:-/tmp/site}"
for i in $(seq 1 "$pairs"); do
  PYTHONPATH="$site:/tmp/old" python3 -m "$old_module" "$@" --json "$out/versions-$name-old-$i.json" | tail -4
  PYTHONPATH="$site:/tmp/new" python3 -m mlx_speculative.benchmarks "$@" --json "$out/versions-$name-new-$i.json" | tail -4
done
python3 bench/versions_ab.py "$out"/versions-"$name"-{old,new}-*.json --json "$out/versions-$name-summary.json"
