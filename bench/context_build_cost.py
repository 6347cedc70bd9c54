"""The DFlash drafter's first context (a whole prompt's target features into its caches), fresh and warm.

    python bench/context_build_cost.py --lengths 2048,8192,16384 --json out.json

A round's first ``prepare`` (drafters/dflash/batch.py) turns the prompt's captured target layers into
the drafter's context K/V: the features (the taps concatenated, the last one normed) padded to the
append counts, then chunks of ``CONTEXT_CHUNK`` through the fc and each layer's K/V: at 17,275 prompt
positions on the H200 the first round's ``prepare`` cost 52.9 ms fresh against 30.5 warm
(bench/round_trace.py, bench/results/profiles/h200-round-trace-reserved.json). This times, with the plugin's backend (plugin/cuda/__init__.py backend_for) and the DFlash-shape
drafter of ``mlx-spec bench``, each length twice in a row after ``mx.clear_cache()`` as the bench does
(fresh: a length never run before; warm: the same again), synchronised:

- ``features_ms``: the features alone (concatenation, norm);
- ``prepare_ms``: ``DFlashBatch.sync`` + ``prepare`` for one row holding the prompt's captures (what
  the round pays), the caches evaluated;
- ``append_ms``: at other new lengths, the appends alone on fresh caches, their buffers ``reserved`` once
  after the first chunk (``DFlashBatch._append``) or ``grown`` chunk by chunk (as it did before);
- with ``--touch-gib G`` a fresh length runs again after ``G`` GiB were allocated, written and freed
  first (``touched_ms``): if the fresh cost is memory the process meets for the first time, it goes.

``--chunk 512,2048`` times the first two with each longest append in turn (``DFlashBatch.context_chunk``; the
counts up to the largest pre-warmed): fewer, longer appends launch fewer operations and read the fc's weight
fewer times, at the price of a longer padded tail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_speculative.drafters.dflash.batch import CONTEXT_CHUNK, DFlashBatch, context_chunks  # noqa: E402
from mlx_speculative.drafters.dflash.features import target_features  # noqa: E402
from mlx_speculative.hooks import attention as host_attention  # noqa: E402
from mlx_speculative.hooks.prompt_cache import arrays  # noqa: E402
from mlx_speculative.hooks.transaction import CacheTransaction  # noqa: E402
from mlx_speculative.plugin import cuda  # noqa: E402
from mlx_speculative.benchmarks import synthetic  # noqa: E402
from mlx_speculative.benchmarks.core import BenchSettings  # noqa: E402
from mlx_speculative.benchmarks.loaders import load_target  # noqa: E402


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def captures_for(drafter: Any, n: int, hidden: int, dtype: Any, seed: int) -> Dict[int, mx.array]:
    out = {i: (0.1 * mx.random.normal((1, n, hidden), key=mx.random.key(1000 * seed + i))).astype(dtype)
           for i in drafter.capture_layers()}
    mx.eval(list(out.values()))
    return out


def prepare_ms(drafter: Any, captures: Dict[int, mx.array], n: int, chunk: Optional[int] = None) -> float:
    """One row's first prepare over ``n`` prompt positions (appends of at most ``chunk``), synchronised."""
    batch = DFlashBatch(drafter)
    batch.context_chunk = chunk
    row = SimpleNamespace(captures=captures, tokens=[0] * (n + 1))
    mx.synchronize()
    t = time.perf_counter()
    batch.sync([row])
    batch.prepare([row])
    mx.eval(arrays(batch.cache))
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def grown(drafter: Any, caches: List[Any], feats: mx.array, n: int, chunk: Optional[int] = None) -> None:
    """``DFlashBatch._append`` before it reserved: the shape-stable chunks appended one by one, each
    growing the padded buffers (a concatenation per chunk)."""
    width, chunk = context_chunks(n, chunk)
    feats = mx.concatenate([feats, mx.zeros((1, width - n, feats.shape[2]), feats.dtype)], axis=1)
    with CacheTransaction(caches) as txn:
        for start in range(0, width, chunk):
            drafter.append_context(caches, feats[:, start:start + chunk])  # [1, <= chunk, F]
        txn.commit([n], written=width)


def append_ms(drafter: Any, captures: Dict[int, mx.array], n: int, reserved: bool, chunk: Optional[int] = None) -> float:
    """The first context's appends alone on fresh caches: ``DFlashBatch._append`` (buffers ``reserved`` once
    after the first chunk) or ``grown`` chunk by chunk."""
    feats = target_features(captures, drafter.capture_layers(), drafter.final_norm)
    mx.eval(feats)
    batch = DFlashBatch(drafter)
    batch.context_chunk = chunk
    caches = drafter.make_cache()
    mx.synchronize()
    t = time.perf_counter()
    if reserved:
        batch._append(caches, feats, [n])
    else:
        grown(drafter, caches, feats, n, chunk)
    mx.eval(arrays(caches))
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def features_ms(drafter: Any, captures: Dict[int, mx.array]) -> float:
    mx.synchronize()
    t = time.perf_counter()
    mx.eval(target_features(captures, drafter.capture_layers(), drafter.final_norm))
    mx.synchronize()
    return (time.perf_counter() - t) * 1e3


def touch(gib: float) -> None:
    """Allocate, write and free ``gib`` GiB (the allocator's pool then holds it)."""
    parts = [mx.ones((2**28,), dtype=mx.bfloat16) for _ in range(max(1, int(gib * 2)))]  # 512 MiB each
    mx.eval(parts)
    del parts
    mx.clear_cache()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--synthetic-target", default="llama-8b", help=f"one of {', '.join(synthetic.SPECS)}")
    p.add_argument("--lengths", type=_ints, default=[2048, 8192, 16384], help="prompt positions")
    p.add_argument("--dflash-layers", type=int, default=5)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--touch-gib", type=float, default=0.0, help="then each length again after touching G GiB")
    p.add_argument("--chunk", type=_ints, default=[CONTEXT_CHUNK],
                   help=f"the longest append, powers of two (default {CONTEXT_CHUNK}, the drafter's); several: each in turn, "
                        "its counts pre-warmed")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    for c in a.chunk:
        context_chunks(c + 1, c)  # a bad --chunk says what is allowed before anything runs
    if a.cpu:
        mx.set_default_device(mx.cpu)
    target, config, note = load_target(BenchSettings(synthetic_target=a.synthetic_target))
    policy = cuda.backend_for()
    drafter, desc = synthetic.dflash_drafter(target.model, config, a.block, a.dflash_layers, 2, policy)
    if policy is not None and policy.shape_stable:
        from mlx_speculative.drafters.dflash import prewarm

        host_attention.route_policy(drafter.model, policy)
        prewarm(drafter, max(a.lengths) + 512, a.block, max(a.chunk))
    hidden, dtype = int(config["hidden_size"]), drafter.model.norm.weight.dtype
    small = captures_for(drafter, 64, hidden, dtype, 0)
    prepare_ms(drafter, small, 64)  # the warm-up of the bench: a short prompt first
    rows = []
    for ci, chunk in enumerate(a.chunk):  # each chunk at lengths of its own (fresh: never run before)
        for i, n in enumerate(a.lengths):
            m = n + 7 * ci
            caps = captures_for(drafter, m, hidden, dtype, i + 1)
            row: Dict[str, Any] = {"positions": m, "chunk": chunk}
            for regime in ("fresh", "warm"):
                mx.clear_cache()
                row[f"features_ms_{regime}"] = round(features_ms(drafter, caps), 2)
                mx.clear_cache()
                row[f"prepare_ms_{regime}"] = round(prepare_ms(drafter, caps, m, chunk), 2)
            del caps
            rows.append(row)
            print(row, flush=True)
        for i, n in enumerate(a.lengths):  # other new lengths: the appends alone, grown and reserved
            for reserved in (False, True):
                m = n + 37 + 61 * reserved + 7 * ci
                caps = captures_for(drafter, m, hidden, dtype, 50 + 2 * i + reserved)
                row = {"positions": m, "chunk": chunk, "appends": "reserved" if reserved else "grown"}
                for regime in ("fresh", "warm"):
                    mx.clear_cache()
                    row[f"append_ms_{regime}"] = round(append_ms(drafter, caps, m, reserved, chunk), 2)
                del caps
                rows.append(row)
                print(row, flush=True)
    if a.touch_gib:
        for i, n in enumerate(a.lengths):
            m = n + 101  # a length never run before
            caps = captures_for(drafter, m, hidden, dtype, 100 + i)
            touch(a.touch_gib)
            row = {"positions": m, "touched_gib": a.touch_gib, "prepare_ms_touched": round(prepare_ms(drafter, caps, m), 2)}
            mx.clear_cache()
            row["prepare_ms_warm"] = round(prepare_ms(drafter, caps, m), 2)
            del caps
            rows.append(row)
            print(row, flush=True)
    report = {"target": note, "drafter": desc, "device": str(mx.default_device()), "mlx": mx.__version__,
              "cache_policy": type(policy).__name__ if policy is not None else None, "settings": vars(a),
              "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 2), "results": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
