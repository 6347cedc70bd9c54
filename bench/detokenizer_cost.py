"""What mlx-lm's streaming detokenizer costs a token on the generation thread, for the served benchmark's synthetic
tokenizer (bench/server_batching.py ``word_tokenizer``: byte-level, so mlx-lm picks its BPE streaming detokenizer)
and for the word-level one it replaced (mlx-lm falls back to its naive detokenizer, which decodes the whole text
again at every token: quadratic in a line that never ends).

    python bench/detokenizer_cost.py [--tokens 64,256] [--vocab 4096] [--json out.json]

Not a test; a CPU figure (the detokenizer is Python and the tokenizers library, no device work).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import server_batching  # noqa: E402


def word_level(vocab: int, root: Path) -> Any:
    """The tokenizer ``word_tokenizer`` replaced: word-level ids "w<i>", a WordPiece decoder."""
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = {("</s>" if i == 1 else "[UNK]" if i == 2 else f"w{i}"): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "[UNK]"}))
    return load_tokenizer(root)


def per_token_ms(tokenizer: Any, ids: List[int], repeats: int) -> float:
    """Median over ``repeats`` of the ms a token that streaming ``ids`` through the detokenizer takes."""
    runs = []
    for _ in range(repeats):
        detok = tokenizer.detokenizer
        detok.reset()
        t0 = time.perf_counter()
        for t in ids:
            detok.add_token(t)
            detok.last_segment
        runs.append(1e3 * (time.perf_counter() - t0) / len(ids))
    return sorted(runs)[len(runs) // 2]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="64,256", help="stream lengths (tokens in one line)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    results: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in (("byte-level", server_batching.word_tokenizer), ("word-level", word_level)):
            tokenizer = make(args.vocab, Path(tmp) / name)
            results[name] = {"detokenizer": type(tokenizer.detokenizer).__name__, "ms_per_token": {}}
            for n in (int(x) for x in args.tokens.split(",")):
                ids = [rng.randrange(3, args.vocab) for _ in range(n)]
                results[name]["ms_per_token"][str(n)] = round(per_token_ms(tokenizer, ids, args.repeats), 4)
            print(name, results[name], flush=True)
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python bench/detokenizer_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "platform": platform.platform(), "python": platform.python_version(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
