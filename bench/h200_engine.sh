#!/usr/bin/env bash
# The H200 runs behind issues 12 and 13 (one decode engine; scoped recurrent rollback): this code against
# commit 713e304 (the last before the engine), alternating on one machine, plus the server batching there.
#
# Run from the repo root on the GPU machine with MLX-CUDA staged (../shared/gpu/prepare-mlx-cuda.sh) and the
# old code unpacked in .old/ (git archive 713e304 hooks plugin drafters | tar -x -C .old). Usage:
#   bash bench/h200_engine.sh bench 1 2      # bench pairs 1 and 2 (old then new each)
#   bash bench/h200_engine.sh server         # bench/server_batching.py, llama-8b shape, 8 clients
#   bash bench/h200_engine.sh recurrent      # bench/recurrent_commit.py, qwen3_5 4b shape, old then new
#   bash bench/h200_engine.sh ab             # bench/engine_ab.py: old and new in one process, alternating
#   bash bench/h200_engine.sh prompt-cache   # bench/prompt_cache_ttft.py (issue 18): turn 2 of an 8k chat
# Results go to $OUT (the device tool's output folder) or ./h200-out.
set -euo pipefail
OUT=${OUT:-h200-out}
mkdir -p "$OUT" /tmp/new/mlx_speculative /tmp/old/mlx_speculative
for d in hooks plugin drafters; do
  ln -sfn "$PWD/$d" "/tmp/new/mlx_speculative/$d"
  ln -sfn "$PWD/.old/$d" "/tmp/old/mlx_speculative/$d"
done
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
new() { env PYTHONPATH="$SITE:/tmp/new" python3 "$@"; }
old() { env PYTHONPATH="$SITE:/tmp/old" python3 "$@"; }
BENCH=(-m mlx_speculative.plugin.bench --synthetic-target llama-8b --kind dflash --oracle-acceptance 6.5
       --block-sizes 16 --prompt-lengths 512,1024 --max-tokens 256 --no-mlx-lm-spec)
what=$1; shift
case "$what" in
  bench)
    for i in "$@"; do
      old "${BENCH[@]}" --json "$OUT/h200-engine-old-$i.json" | tail -12
      new "${BENCH[@]}" --json "$OUT/h200-engine-new-$i.json" | tail -12
    done ;;
  server)
    new bench/server_batching.py --synthetic-target llama-8b --clients 8 --duration 30 --max-tokens 64 \
      --prompt-words 256 --json "$OUT/h200-server-batching.json" ;;
  recurrent)
    old bench/recurrent_commit.py --shape 4b --block 16 --rounds 20 --json "$OUT/h200-recurrent-commit-old.json"
    new bench/recurrent_commit.py --shape 4b --block 16 --rounds 20 --json "$OUT/h200-recurrent-commit-new.json" ;;
  ab)  # both versions in one process, alternating runs (bench/engine_ab.py)
    mkdir -p /tmp/oldpkg && ln -sfn "$PWD/.old" /tmp/oldpkg/mlx_speculative_old
    new bench/engine_ab.py --old-root /tmp/oldpkg --synthetic-target llama-8b --pairs 3 --prompt-lengths 512,1024 \
      --max-tokens 256 --json "$OUT/h200-engine-ab.json" ;;
  prompt-cache)  # issue 18: TTFT of turn 2, cache on / off / mlx_lm.server, 1B-shape target saved to disk
    new bench/prompt_cache_ttft.py --synthetic-target llama-1b --context 8192 --answer 64 --repeats 5 \
      --root /tmp/prompt-cache --json "$OUT/h200-prompt-cache-ttft.json" ;;
  recurrent-new)
    new bench/recurrent_commit.py --shape 4b --block 16 --rounds 20 --json "$OUT/h200-recurrent-commit-new.json" ;;
  train)  # issue 15's smoke test of mlx-spec train-drafter on MLX-CUDA (an installed copy: entry points)
    python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/site2 . >/dev/null
    t() { env PYTHONPATH="$SITE:/tmp/site2" python3 "$@"; }
    t -c "from pathlib import Path; from mlx_speculative.hooks import tiny_models as tm; tm.make_checkpoint(Path('/tmp/smoke/target'), tm.llama_config(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64), seed=1, logit_scale=3.0, quiet_layers_from=2)"
    for k in dflash draft_model; do
      t -m mlx_speculative.hooks.cli train-drafter --target /tmp/smoke/target --kind $k --data README.md bench/README.md \
        --out /tmp/smoke/$k --steps 120 --batch-size 16 --seq-len 128 --prompt-tokens 16 --block-size 8 --lr 3e-3 \
        --eval-every 60 --checkpoint-every 60 --log-every 30 2>&1 | tail -6
      t -m mlx_speculative.hooks.cli check --model /tmp/smoke/target --draft-model /tmp/smoke/$k | head -3
      t -m mlx_speculative.hooks.cli generate --model /tmp/smoke/target --draft-model /tmp/smoke/$k --draft-block-size 8 \
        -m 64 -p "the model" --json --ignore-chat-template | python3 -c "import json,sys; r=json.load(sys.stdin); print('$k', r['speculative'])"
    done 2>&1 | tee "$OUT/h200-train-smoke.txt" ;;
  *) echo "unknown: $what (bench N.. | ab | server | recurrent | recurrent-new | prompt-cache | train)"; exit 2 ;;
esac
