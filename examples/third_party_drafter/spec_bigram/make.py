"""Write a bigram checkpoint from a target: ``python -m spec_bigram.make --target demo --out ./my-bigram``.

Row t of the table is the target's logits for the next token after the one-token prompt [t], so
the drafter proposes what the target itself would say after the last token alone. The table is
[V, V] floats (V = the target's vocab_size), so this is for small vocabularies: 32768 tokens
already take 4 GiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

from . import MODEL_TYPE

MAX_VOCAB = 32768
ROWS_PER_FORWARD = 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def make(target: str, out: Path) -> Path:
    from mlx_lm import load

    from mlx_speculative.hooks.api import read_config, resolve_path

    path = resolve_path(target, "target")
    config = read_config(path, "target")
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int) or not 0 < vocab <= MAX_VOCAB:
        raise ValueError(f"target vocab_size: got {vocab!r}; allowed: 1 to {MAX_VOCAB} (the table is [V, V])")
    model, _ = load(str(path))
    rows: List[mx.array] = []
    for start in range(0, vocab, ROWS_PER_FORWARD):
        tokens = mx.arange(start, min(start + ROWS_PER_FORWARD, vocab))[:, None]  # [n, 1]: one prompt per token
        rows.append(model(tokens)[:, -1, :vocab].astype(mx.float32))  # [n, V]
        mx.eval(rows[-1])
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {"bigram.weight": mx.concatenate(rows)})
    (out / "config.json").write_text(json.dumps({"model_type": MODEL_TYPE, "vocab_size": vocab}, indent=1))
    for name in TOKENIZER_FILES:  # the same vocabulary as the target, for `mlx-spec check`
        if (path / name).is_file():
            shutil.copy(path / name, out / name)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spec_bigram.make", description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="target model: path, HF repo id or 'demo'")
    p.add_argument("--out", required=True, type=Path, help="folder to write (config.json, model.safetensors)")
    args = p.parse_args(argv)
    try:
        out = make(args.target, args.out)
    except (ValueError, OSError) as e:
        print(f"spec_bigram.make: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}/model.safetensors (bigram.weight) and config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
