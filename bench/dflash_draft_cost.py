"""Cost of one DFlash drafting step at a real checkpoint's size (random weights, no target needed).

    python bench/dflash_draft_cost.py --config path/to/dflash/config.json [--json out.json]

Each simulated round appends ``--accepted + 1`` context positions (as after a round that accepted
``--accepted`` drafts), runs the drafter over a block of ``--block`` positions and the target-sized
head over its B-1 draft positions, then argmax. Reported per round: first pass (key lengths never
seen before: on CUDA each one compiles an attention kernel) and a second pass over the same shapes.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_speculative.drafters.dflash.model import Model, ModelArgs


def _rounds(model: Model, embed: nn.Module, head: nn.Module, hidden: mx.array, cache: List[Any], rounds: int,
            block: int, step: int, mask_id: int) -> List[float]:
    times = []
    taps = hidden.shape[-1]
    model.append_context(hidden, cache)  # the prompt's context
    mx.eval([c.keys for c in cache])
    for r in range(rounds):
        new = mx.random.normal((1, step, taps)).astype(hidden.dtype)  # [1, a+1, taps*H]
        mx.eval(new)
        t0 = time.perf_counter()
        ids = mx.array([[r % 1000] + [mask_id] * (block - 1)], dtype=mx.uint32)
        model.append_context(new, cache)
        h = model(embed(ids), cache)  # [1, B, H]
        tokens = mx.argmax(head(h[:, 1:]), axis=-1)  # [1, B-1]
        mx.eval(tokens, [c.keys for c in cache])
        times.append(time.perf_counter() - t0)
    return times


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/dflash_draft_cost.py")
    p.add_argument("--config", required=True, help="a DFlash config.json")
    p.add_argument("--context", type=int, default=512, help="prompt positions before the first round")
    p.add_argument("--rounds", type=int, default=64)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--accepted", type=int, default=6, help="drafts accepted per simulated round")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bucket", type=int, default=256, help="padded context cache bucket (0: plain KVCache)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)

    config: Dict[str, Any] = json.loads(open(args.config).read())
    margs = ModelArgs.from_dict(config)
    dtype = getattr(mx, args.dtype)
    model = Model(margs)
    model.set_dtype(dtype)
    vocab = margs.vocab_size or 151936
    embed, head = nn.Embedding(vocab, margs.hidden_size), nn.Linear(margs.hidden_size, vocab, bias=False)
    embed.set_dtype(dtype)
    head.set_dtype(dtype)
    mx.eval(model.parameters(), embed.parameters(), head.parameters())
    taps = len(margs.target_layer_ids) * margs.hidden_size
    hidden = mx.random.normal((1, args.context, taps)).astype(dtype)
    results = {}
    for name, factory in _factories(args.bucket).items():
        passes = []
        for _ in range(2):
            mx.random.seed(0)
            passes.append(_rounds(model, embed, head, hidden, model.make_cache(factory), args.rounds, args.block,
                                  args.accepted + 1, int(margs.mask_token_id or 0)))
        results[name] = {
            "first_pass_ms_per_round": round(1e3 * sum(passes[0]) / args.rounds, 3),
            "second_pass_ms_per_round": round(1e3 * sum(passes[1]) / args.rounds, 3),
            "second_pass_median_ms": round(1e3 * sorted(passes[1])[args.rounds // 2], 3),
        }
    text = json.dumps({"device": str(mx.default_device()), "config": args.config, "dtype": args.dtype,
                       "context": args.context, "rounds": args.rounds, "block": args.block,
                       "context_per_round": args.accepted + 1, "results": results}, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


def _factories(bucket: int) -> Dict[str, Callable[[], Any]]:
    from mlx_lm.models.cache import KVCache

    out: Dict[str, Callable[[], Any]] = {"KVCache": KVCache}
    if bucket:
        from mlx_speculative.plugin.cuda.backend import PaddedKVCache

        out[f"PaddedKVCache({bucket})"] = lambda: PaddedKVCache(bucket)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
