#!/usr/bin/env bash
# Issue 15: the embedded demo made from scratch on the GPU machine (demo/build.py), resumable across calls.
# Run from the repo root with MLX-CUDA staged (../shared/gpu/prepare-mlx-cuda.sh). Usage:
#   bash bench/h200_demo.sh build [SECONDS]   # run again until it installs; state in /tmp/demo-work
#   bash bench/h200_demo.sh drafters [SECONDS] # the same, keeping the shipped target (demo/target and its seconds in
#                                             # demo/manifest.json): every drafter trained again
#   bash bench/h200_demo.sh sweep [VARIANT...]   # target variants' bits per byte on a validation split of the
#                                             # training files (bench/demo_target_sweep.py; default: 1000,
#                                             # 2000, 4000 steps), to choose the target the build makes
#   bash bench/h200_demo.sh bench             # mlx-spec bench with the real drafters + the acceptance script (bf16)
#   bash bench/h200_demo.sh prompts           # prompts.json made again from the pinned corpus (with the parse rule's
#                                             # preambles) to $OUT/prompts.json
#   bash bench/h200_demo.sh save              # finished stages' state to $OUT/demo-work.tgz (a new machine can
#                                             # continue from it: unpack it as .demo-work and carry that)
# The finished demo comes back as $OUT/demo.tar (unpack it into the repo's demo/). The device tool returns few
# files per call, hence the archives.
set -euo pipefail
OUT=${OUT:-h200-out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target /tmp/site2 . >/dev/null 2>&1
export PYTHONPATH="$SITE:/tmp/site2" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORK=/tmp/demo-work
if [ -d .demo-work ] && [ ! -d "$WORK" ]; then cp -r .demo-work "$WORK"; fi
case "$1" in
  drafters|build)
    if [ "$1" = drafters ] && [ ! -f "$WORK/target-info.json" ]; then
      python3 - "$WORK" <<'PY'
import json, shutil, sys
from pathlib import Path
work = Path(sys.argv[1])
work.mkdir(parents=True, exist_ok=True)
shipped = json.loads(Path("demo/manifest.json").read_text())
shutil.copytree("demo/target", work / "target")
(work / "target-info.json").write_text(json.dumps(shipped["target"], indent=1))
(work / "times.json").write_text(json.dumps({"target": shipped["seconds"]["target"]}, indent=1))
PY
    fi
    pin=(); if [ -f demo/manifest.json ]; then pin=(--pin demo/manifest.json); fi
    rc=0
    python3 -m mlx_speculative.demo.build --work "$WORK" --out /tmp/demo-out "${pin[@]}" --max-time "${2:-540}" || rc=$?
    if [ "$rc" = 0 ]; then tar -C /tmp/demo-out -cf "$OUT/demo.tar" .; fi
    (cd "$WORK" && tar -czf "$OUT/demo-logs.tgz" times.json $(ls -d */training/log.jsonl 2>/dev/null)) || true
    exit "$rc" ;;
  sweep)
    shift; variants=("$@"); [ ${#variants[@]} -gt 0 ] || variants=(steps=1000 steps=2000 steps=4000)
    args=(); for v in "${variants[@]}"; do args+=(--variant "$v"); done
    python3 bench/demo_target_sweep.py --pin demo/manifest.json "${args[@]}" --max-time 480 \
      --json "$OUT/h200-demo-target-sweep.json" 2>&1 | grep -v "^target step" | tail -20 ;;
  bench)  # the demo on this GPU: mlx-spec bench with its real drafters, then the acceptance script in bf16
    D=/tmp/demo-out; [ -d "$D/target" ] || D=demo  # a build on this machine, else the shipped demo
    python3 -m mlx_speculative.hooks.cli bench --model $D/target --drafter $D/dflash@16 --drafter $D/eagle3@8 \
      --drafter $D/mtp@4 --drafter $D/draft_model@4 --kind ngram --prompts-file $D/prompts.json --max-prompts 8 \
      --max-tokens 128 --json "$OUT/h200-demo-bench.json" 2>&1 | tail -30
    timeout 200 python3 bench/demo_acceptance.py --demo-dir $D --prompts 32 --max-tokens 128 --dtype native \
      --sampled-prompts 0 --json "$OUT/h200-demo-acceptance-bf16.json" 2>&1 | tail -14 ;;
  prompts)
    python3 -m mlx_speculative.demo.build --pin demo/manifest.json --prompts "$OUT/prompts.json" ;;
  save)
    rm -rf /tmp/demo-save
    python3 - "$WORK" /tmp/demo-save <<'PY'
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
    tar -C /tmp/demo-save -czf "$OUT/demo-work.tgz" . ;;
  *) echo "unknown: $1 (build [SECONDS] | drafters [SECONDS] | sweep [VARIANT...] | bench | prompts | save)"; exit 2 ;;
esac
