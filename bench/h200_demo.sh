#!/usr/bin/env bash
# Issue 15: the embedded demo made from scratch on the GPU machine (demo/build.py), resumable across calls.
# Run from the repo root with MLX-CUDA staged (../shared/gpu/prepare-mlx-cuda.sh). Usage:
#   bash bench/h200_demo.sh build [SECONDS]   # run again until it installs; state in /tmp/demo-work
#   bash bench/h200_demo.sh save              # the state a new machine needs, to $OUT/demo-work (no sequences,
#                                             # no optimiser state): carry it back as .demo-work
# The finished demo goes to $OUT/demo (copy it into the repo's demo/).
set -euo pipefail
OUT=${OUT:-h200-out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site2 . >/dev/null 2>&1
export PYTHONPATH="$SITE:/tmp/site2" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORK=/tmp/demo-work
if [ -d .demo-work ] && [ ! -d "$WORK" ]; then cp -r .demo-work "$WORK"; fi
case "$1" in
  build)
    pin=(); if [ -f demo/manifest.json ]; then pin=(--pin demo/manifest.json); fi
    rc=0
    python3 -m mlx_speculative.demo.build --work "$WORK" --out /tmp/demo-out "${pin[@]}" --max-time "${2:-540}" || rc=$?
    if [ "$rc" = 0 ]; then mkdir -p "$OUT/demo" && cp -r /tmp/demo-out/. "$OUT/demo/"; fi
    exit "$rc" ;;
  save)
    python3 - "$WORK" "$OUT/demo-work" <<'PY'
import json, shutil, sys
from pathlib import Path
work, dest = Path(sys.argv[1]), Path(sys.argv[2])
skip = {"target-training", "tokens.npz"}
for f in work.rglob("*"):
    rel = f.relative_to(work)
    if not f.is_file() or rel.parts[0] in skip or rel.name in ("train.txt", "heldout.txt", "data.safetensors") \
            or any(p.startswith("step-") for p in rel.parts):
        continue
    state = work / rel.parts[0] / "training" / "state.json"
    if state.exists() and not json.loads(state.read_text()).get("complete"):
        continue  # a drafter stopped half way starts again on the next machine
    (dest / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(f, dest / rel)
print(sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()) / 2**20, "MB saved")
PY
    ;;
  *) echo "unknown: $1 (build [SECONDS] | save)"; exit 2 ;;
esac
