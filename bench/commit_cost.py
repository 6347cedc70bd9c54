"""What committing and aborting a round costs, as a share of round time, per architecture (CPU).

Not a test. For each architecture (tiny random weights unless --hidden is given) it prefills a
prompt longer than the sliding window (so rotating caches have wrapped), then runs rounds of
block size B: one verify forward over B positions inside a cache transaction
(hooks/transaction.py), then ``commit(n)`` for n = 1 .. B in turn (n = 1: no draft accepted,
1 < n < B: partial, n = B: all accepted), or ``abort()``. Lazy work is forced with ``mx.eval`` on
the caches, so what a commit defers is counted in the commit.

round time = verify (forward + eval) + commit; the drafter's time is left out (it depends on the
drafter), which makes the reported share an upper bound.

Recurrent caches (ArraysCache) keep a partial block from the recording of the model's recurrent
layers, which ``hooks.recurrent.scope_model`` sets up (the host does it for every model it loads).
``--no-tape`` leaves the model unscoped, so they restore and replay the kept tokens through the
model (the fallback), for a comparison under the same machine load.

    python bench/commit_cost.py                   # all architectures, B = 8
    python bench/commit_cost.py --block 16 --rounds 8 --arch qwen3_5 gemma3_text
    python bench/commit_cost.py --arch qwen3_5 falcon_h1 mamba2 --no-tape --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_speculative.testing import tiny_models as tm
from mlx_speculative.hooks.recurrent import scope_model
from mlx_speculative.hooks.transaction import CacheTransaction

ARCHS = tm.ARCH_CONFIGS


def arrays(cache: List[Any]) -> List[mx.array]:
    return [x for _, x in tree_flatten([c.state for c in cache]) if isinstance(x, mx.array)]


def cache_kinds(cache: List[Any]) -> str:
    names: List[str] = []
    for c in cache:
        name = type(c).__name__
        if name == "CacheList":
            name = "CacheList(" + ",".join(type(x).__name__ for x in c.caches) + ")"
        if name not in names:
            names.append(name)
    return "+".join(names)


def bench(arch: str, block: int, rounds: int, prompt_len: int, hidden: int, tape: bool) -> Dict[str, Any]:
    over: Dict[str, Any] = {}
    if hidden:
        over = {"hidden_size": hidden, "intermediate_size": 2 * hidden}
    mx.random.seed(0)
    model = tm.build_model(ARCHS[arch](**over))
    mx.eval(model.parameters())
    scoped = scope_model(model) if tape else 0
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(3, 384, (prompt_len + (rounds + 1) * block * (block + 1),)).tolist()
    model(mx.array([tokens[:prompt_len]]), cache=cache)
    mx.eval(arrays(cache))
    pos = prompt_len
    verify: List[float] = []
    by_n: Dict[int, List[float]] = {n: [] for n in range(block + 1)}  # n = 0: abort
    replayed: Dict[int, int] = {n: 0 for n in range(block + 1)}
    taped: Dict[int, int] = {n: 0 for n in range(block + 1)}

    def round_(n: int) -> None:
        nonlocal pos
        fed = tokens[pos : pos + block]
        t0 = time.perf_counter()
        txn = CacheTransaction(cache, replay=lambda m: model(mx.array([fed[:m]]), cache=cache)).begin()
        logits = model(mx.array([fed]), cache=cache)  # [1, B, V]
        mx.eval(logits, arrays(cache))
        t1 = time.perf_counter()
        if n == 0:
            txn.abort()
        else:
            txn.commit(n, written=block)
        mx.eval(arrays(cache))
        t2 = time.perf_counter()
        verify.append(t1 - t0)
        by_n[n].append(t2 - t1)
        replayed[n] += bool(txn.replayed)
        taped[n] += txn.taped > 0
        pos += n

    for _ in range(2):  # warm-up
        round_(1)
    verify.clear()
    by_n = {n: [] for n in range(block + 1)}
    replayed = {n: 0 for n in range(block + 1)}
    taped = {n: 0 for n in range(block + 1)}
    for _ in range(rounds):
        for n in range(0, block + 1):
            round_(n)
    # Medians (the machine may be shared), then the mean over n = 1..B: every acceptance length alike.
    v = statistics.median(verify)
    per_n = {n: statistics.median(t) for n, t in by_n.items()}
    c = statistics.mean(per_n[n] for n in range(1, block + 1))
    a = per_n[0]
    worst = max(per_n[n] for n in range(1, block + 1))
    cases = {"zero": 1, "partial": max(1, block // 2), "full": block}
    return {
        "arch": arch, "caches": cache_kinds(cache), "scoped_layers": scoped, "verify_ms": 1e3 * v,
        "commit_ms": 1e3 * c, "commit_share": c / (v + c), "abort_ms": 1e3 * a, "abort_share": a / (v + a),
        "replayed": sum(replayed[n] for n in range(1, block + 1)) / (rounds * block),
        "taped": sum(taped[n] for n in range(1, block + 1)) / (rounds * block),
        "worst_commit_share": worst / (v + worst),
        "commit_ms_by_kept": {str(n): 1e3 * per_n[n] for n in range(1, block + 1)},
        "cases": {name: {"kept": n, "commit_ms": 1e3 * per_n[n], "commit_share": per_n[n] / (v + per_n[n]),
                         "rounds_replayed": replayed[n], "rounds_from_recording": taped[n]}
                  for name, n in cases.items()},
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--arch", nargs="*", default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--block", type=int, default=8, help="block size B (positions per verify)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per commit length")
    parser.add_argument("--prompt", type=int, default=40, help="prompt length (wraps the sliding windows of 8)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (default: the tiny test configs, 64)")
    parser.add_argument("--no-tape", action="store_true",
                        help="leave the model unscoped: recurrent caches replay the kept tokens (the fallback path)")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    print(f"block size {args.block}, commit(n) for n = 1..{args.block} and abort, {args.rounds} rounds each, "
          f"prompt {args.prompt}, hidden {args.hidden or 'tiny (64)'}, recording {'off' if args.no_tape else 'on'}, "
          f"device {mx.default_device()}")
    header = (f"{'arch':12} {'caches':44} {'verify ms':>9} {'commit ms':>9} {'share':>6} {'worst':>6} {'tape':>5} "
              f"{'replay':>6} {'abort ms':>8} {'share':>6}")
    print(header)
    print("-" * len(header))
    results = []
    for arch in args.arch:
        r = bench(arch, args.block, args.rounds, args.prompt, args.hidden, not args.no_tape)
        results.append(r)
        print(f"{r['arch']:12} {r['caches']:44} {r['verify_ms']:9.2f} {r['commit_ms']:9.3f} "
              f"{100 * r['commit_share']:5.1f}% {100 * r['worst_commit_share']:5.1f}% {100 * r['taped']:4.0f}% "
              f"{100 * r['replayed']:5.0f}% "
              f"{r['abort_ms']:8.3f} {100 * r['abort_share']:5.1f}%")
    print("medians per commit length; share: commit / (verify + commit), mean over n = 1..B; worst: the "
          "costliest n; tape: commits kept from the recording (recurrent caches, n < B); replay: commits "
          "that fed the kept tokens again through the model")
    if args.json:
        report = {"block": args.block, "rounds": args.rounds, "prompt": args.prompt, "hidden": args.hidden or 64,
                  "recording": not args.no_tape, "device": str(mx.default_device()), "mlx": mx.__version__,
                  "platform": platform.platform(), "results": results}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
