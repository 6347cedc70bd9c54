#!/usr/bin/env bash
# On the GPU machine: append one part of a GGUF cut by `python bench/real_models.py split NAME` to
# $dest/NAME.gguf; after the last part, check the sha256 (OUT/NAME.sha256 travels with every part).
#   bash bench/real_stage.sh .gpu/real/NAME.NN
set -euo pipefail
part="$1"; dir="$(dirname "$part")"; base="$(basename "$part")"; name="${base%.*}"; n="${base##*.}"
dest="${REAL_DIR:-/tmp/real}"; mkdir -p "$dest"
read -r sha _ total < "$dir/$name.sha256"
shopt -s nullglob; parts=("$dest/$name".part.*); have=${#parts[@]}
if [ "$((10#$n))" -ne "$have" ]; then echo "[stage] $base: expected part $have next (a new machine starts at 00)"; exit 3; fi
cp "$part" "$dest/$name.part.$n"
if [ "$((10#$n + 1))" -eq "$total" ]; then
  cat "$dest/$name".part.* > "$dest/$name.gguf"; rm "$dest/$name".part.*
  echo "$sha  $dest/$name.gguf" | sha256sum -c - && echo "[stage] $name.gguf complete"
else
  echo "[stage] $name: part $n of $total stored"
fi
