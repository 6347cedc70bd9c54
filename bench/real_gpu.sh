#!/usr/bin/env bash
# The real pair on the GPU machine: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B (draft LM), their GGUF
# files staged into /tmp/real by bench/real_stage.sh, MLX-CUDA in /tmp/site (../shared/gpu/prepare-mlx-cuda.sh;
# docs/gpu.md). The commands that rebuild the trained drafters are here; a trained one comes back in parts (export) to
# go on training on a later machine (staged as /tmp/real/KIND-init).
#   bash bench/real_gpu.sh convert                 # GGUF -> /tmp/real/NAME-bf16 (mlx-spec convert)
#   bash bench/real_gpu.sh train KIND SECONDS [FLAGS]  # KIND dflash or eagle3 for the 1.5B, on the target's greedy
#                                                  # continuations of the Python stdlib; stops after SECONDS with a
#                                                  # checkpoint, and the same command again resumes it (a device
#                                                  # call lasts at most 10 minutes)
#                                                  # (a drafter brought back from an earlier machine, staged into
#                                                  # /tmp/real/KIND-init, is the start of a new run: --init)
#   bash bench/real_gpu.sh export KIND GROUP       # the trained KIND (weights, config, sequences, log) as a tar in
#                                                  # 15 MiB parts; parts 4*GROUP .. 4*GROUP+3 and the sha256 to $OUT
#                                                  # (a call brings back 64 MiB): real_models.py unpack joins them
#   bash bench/real_gpu.sh bench NAME [FLAGS]      # mlx-spec bench on bench/prompts/real_heldout.json -> $OUT/NAME.json
#   bash bench/real_gpu.sh served NAME [FLAGS]     # bench/server_batching.py's real mode -> $OUT/served-NAME.json
set -uo pipefail
out="${OUT:-./real-out}"; real="${REAL_DIR:-/tmp/real}"; mkdir -p "$out"
export_parts() {  # KIND GROUP: needs nothing but the trained folder (no MLX)
  local kind="$1" group="$2" ex="$real/export" files=() f n p i; mkdir -p "$ex"
  if [ ! -f "$ex/$kind.tar.sha256" ]; then
    for f in config.json model.safetensors training/data.safetensors training/log.jsonl; do
      [ -f "$real/$kind/$f" ] && files+=("$kind/$f"); done
    [ ${#files[@]} -gt 0 ] || { echo "[export] no trained $kind in $real"; return 2; }
    tar -cf "$ex/$kind.tar" -C "$real" "${files[@]}" || return 1
    split -b 15M -d -a 2 "$ex/$kind.tar" "$ex/$kind.tar."
    n=$(ls "$ex/$kind.tar".[0-9][0-9] | wc -l)
    echo "$(sha256sum "$ex/$kind.tar" | cut -d' ' -f1)  $kind.tar $n" > "$ex/$kind.tar.sha256"; rm "$ex/$kind.tar"
  fi
  read -r _ _ n < "$ex/$kind.tar.sha256"; cp "$ex/$kind.tar.sha256" "$out/"
  for i in 0 1 2 3; do p=$(printf "%02d" $((4 * group + i))); [ -f "$ex/$kind.tar.$p" ] && cp "$ex/$kind.tar.$p" "$out/"; done
  echo "[export] $kind.tar: $n parts, groups 0..$(( (n - 1) / 4 )); this call: group $group"
}
[ "${1:-}" = export ] && { export_parts "$2" "$3"; exit $?; }
mkdir -p /tmp/new/mlx_speculative
for d in hooks plugin drafters demo benchmarks testing; do ln -sfn "$PWD/$d" "/tmp/new/mlx_speculative/$d"; done
# the gguf reader is pure Python and not in MLX-CUDA's site: carry it as .gpu/gguf (docs/gpu.md)
# (copied once: a later call need not carry it again)
[ -d .gpu/gguf/gguf ] && [ ! -d /tmp/new/gguf ] && cp -r .gpu/gguf/gguf /tmp/new/gguf
export PYTHONPATH="${SITE:-/tmp/site}:/tmp/new" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# not installed there: its entry points (the plugins, the drafter families) from pyproject.toml as dist-info
python3 - <<'PY'
import pathlib, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
info = pathlib.Path("/tmp/new/mlx_speculative-0.0.0.dist-info"); info.mkdir(exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-speculative\nVersion: 0.0.0\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in project["entry-points"].items()))
PY
spec() { python3 -m mlx_speculative.hooks.cli "$@"; }
target="$real/qwen2.5-coder-1.5b-instruct-bf16"; draft="$real/qwen2.5-coder-0.5b-instruct-bf16"
what="$1"; shift
case "$what" in
  convert)
    for name in qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct; do
      [ -f "$real/$name.gguf" ] && [ ! -d "$real/$name-bf16" ] && spec convert "$real/$name.gguf" "$real/$name-bf16" --dtype bf16
    done
    ls "$real" ;;
  train)
    kind="$1"; secs="$2"; shift 2
    case "$kind" in
      # 2 layers reading 5 of the target's 28 (z-lab's spread for 5 taps; its published b16 drafters read 5 or 8):
      # the default ties the taps to the layers, and 2 taps (1, 25) left out most of the target's depth
      dflash) flags=(--block-size 16 --loss-decay-gamma 7); size=(--num-layers 2 --target-layers 1,7,13,19,25) ;;
      eagle3) flags=(--block-size 8); size=() ;;
      *) echo "bench/real_gpu.sh train: got kind ${kind@Q}; expected dflash or eagle3"; exit 2 ;;
    esac
    # the stdlib's own modules (no tests, UTF-8 only): the prompts; the held-out prompts never come from it
    python3 - > /tmp/real-data.txt <<'PY'
import pathlib, sysconfig
skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
for f in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    try:
        if not skip & set(f.parts) and f.read_text(encoding="utf-8").strip():
            print(f)
    except (UnicodeDecodeError, OSError):
        pass
PY
    mapfile -t files < /tmp/real-data.txt; echo "train: ${#files[@]} stdlib files"
    # one data set for both: the same target, text, --sequences, lengths and seed (docs/training.md); the second
    # family reuses the first's continuations. One family at a time: side by side, EAGLE-3's step ran out of memory
    # on an 80 GB H100 next to DFlash's.
    for other in dflash eagle3; do
      if [ "$other" != "$kind" ] && [ -f "$real/$other/training/data.safetensors" ] && [ ! -f "$real/$kind/training/data.safetensors" ]; then
        mkdir -p "$real/$kind/training" && cp "$real/$other/training/data.safetensors" "$real/$kind/training/"
      fi
    done
    # an earlier machine's drafter (no optimizer state travels): a new run from its weights (its size with them), on
    # its sequences; the same --init again when this machine's run resumes (a resumed run keeps its options)
    init=(); resume=()
    [ -f "$real/$kind-init/model.safetensors" ] && { init=(--init "$real/$kind-init"); size=(); }
    if [ -f "$real/$kind/training/state.json" ]; then
      resume=(--resume)
    elif [ ${#init[@]} -gt 0 ] && [ -f "$real/$kind-init/training/data.safetensors" ]; then
      mkdir -p "$real/$kind/training" && cp "$real/$kind-init/training/data.safetensors" "$real/$kind/training/"
    fi
    spec train-drafter --target "$target" --data "${files[@]}" --seq-len 256 --prompt-tokens 64 --sequences 16384 \
      --heldout-sequences 32 --gen-batch 256 --batch-size 16 --steps 9000 --eval-every 1000 --checkpoint-every 500 \
      --kind "$kind" --out "$real/$kind" "${flags[@]}" "${size[@]}" "${init[@]}" --max-time "$secs" "${resume[@]}" "$@" \
      >> "$out/train-$kind.log" 2>&1
    echo "exit $?"
    cp "$real/$kind/training/log.jsonl" "$out/train-$kind.jsonl" 2>/dev/null
    grep -E "eval|stopped|data:|rror|checkpoint" "$out/train-$kind.log" | tail -14 ;;
  bench)
    name="$1"; shift
    spec bench --model "$target" --drafter "$draft@4" --drafter "$real/dflash@16" --drafter "$real/eagle3@8" \
      --kind ngram --prompts-file bench/prompts/real_heldout.json --max-tokens 128 --json "$out/$name.json" "$@" 2>&1 |
      tee "$out/$name.log" | tail -25 ;;
  served)
    name="$1"; shift
    python3 bench/server_batching.py --model "$target" "$@" --json "$out/served-$name.json" 2>&1 | tee "$out/served-$name.log" ;;
  *) echo "bench/real_gpu.sh: got ${what@Q}; expected convert, train, export, bench or served"; exit 2 ;;
esac
