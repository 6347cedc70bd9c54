#!/usr/bin/env bash
# On the GPU machine: append one part of a file cut by `python bench/real_models.py split NAME` (a GGUF, or a trained
# drafter's tar) to $dest/FILE; after the last part, check the sha256 (OUT/NAME.sha256, "SHA  FILE PARTS", travels
# with every part); a tar is then unpacked there, its folder renamed KIND-init (bench/real_gpu.sh train starts from it).
#   bash bench/real_stage.sh .gpu/real/NAME.NN
set -euo pipefail
part="$1"; dir="$(dirname "$part")"; base="$(basename "$part")"; name="${base%.*}"; n="${base##*.}"
dest="${REAL_DIR:-/tmp/real}"; mkdir -p "$dest"
read -r sha file total < "$dir/$name.sha256"
shopt -s nullglob; parts=("$dest/$name".part.*); have=${#parts[@]}
if [ "$((10#$n))" -ne "$have" ]; then echo "[stage] $base: expected part $have next (a new machine starts at 00)"; exit 3; fi
cp "$part" "$dest/$name.part.$n"
if [ "$((10#$n + 1))" -eq "$total" ]; then
  cat "$dest/$name".part.* > "$dest/$file"; rm "$dest/$name".part.*
  echo "$sha  $dest/$file" | sha256sum -c - || exit 4
  echo "[stage] $file complete"
  if [[ "$file" == *.tar ]]; then
    kind="${file%.tar}"; tmp="$dest/.unpack-$kind"; rm -rf "$tmp" "$dest/$kind-init"; mkdir -p "$tmp"
    tar -xf "$dest/$file" -C "$tmp" && mv "$tmp/$kind" "$dest/$kind-init" && rm -rf "$tmp" "$dest/$file"
    echo "[stage] $kind-init unpacked"
  fi
else
  echo "[stage] $name: part $n of $total stored"
fi
