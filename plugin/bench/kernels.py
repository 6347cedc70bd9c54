"""Bare forward costs, timed alone: what a round costs with no machinery at all.

A round is one drafter call and one target forward over the block, one after the other (the
verify needs the drafts). Timed warm and synchronised, they give what a round loop with no
machinery reaches: ``kernel bound = tau * T(one-token step) / (T(draft) + T(verify))``, and with a
drafter that costs nothing, ``verify ceiling = tau * T(one-token step) / T(verify)``. ``mlx-spec
bench`` reports both beside the measured speed-ups; bench/verify_cost.py breaks the forwards down.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ...hooks.batch import forward
from .. import cache_policy


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Median milliseconds of ``fn`` (evaluated and synchronised), after two warm-up calls."""
    for _ in range(2):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _filled_caches(model: Any, key_length: int, bucket: Optional[int]) -> List[Any]:
    cache = cache_policy.make_padded_cache(model, bucket=bucket) if bucket else make_prompt_cache(model)
    prompt = mx.array([[2 + i % 1000 for i in range(key_length)]], dtype=mx.uint32)
    for i in range(0, key_length, 512):
        mx.eval(forward(model, prompt[:, i:i + 512], cache, [])[0][:, -1])
    return cache


def target_forward_ms(model: Any, key_length: int, widths: List[int], iters: int,
                      bucket: Optional[int] = None) -> Dict[int, Dict[str, float]]:
    """width -> {"ms": forward + its log-softmax rows, "build_ms": the graph built on the CPU},
    after ``key_length`` cached positions (a padded cache when ``bucket``)."""
    cache = _filled_caches(model, key_length, bucket)
    out: Dict[int, Dict[str, float]] = {}
    for n in widths:
        toks = mx.array([[3 + (i % 50) for i in range(n)]], dtype=mx.uint32)
        builds: List[float] = []

        def fwd() -> mx.array:
            t = time.perf_counter()
            logits = forward(model, toks, cache, [])[0][0].astype(mx.float32)  # [n, V]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            builds.append((time.perf_counter() - t) * 1e3)
            mx.eval(logprobs)
            for c in cache:
                c.trim(n)
            return logprobs

        ms = timed(fwd, iters)
        out[n] = {"ms": round(ms, 3), "build_ms": round(statistics.median(builds), 3)}
    mx.clear_cache()
    return out


def dflash_block_ms(drafter: Any, key_length: int, block: int, iters: int, new_context: int = 7) -> float:
    """A DFlash round's draft: ``new_context`` new context positions (tau ~6.5 accepted last round)
    and the block through the drafter, then the shared head's argmax."""
    inner = drafter.model
    dtype = inner.norm.weight.dtype
    taps = len(inner.args.target_layer_ids) * inner.args.hidden_size
    caches = drafter.make_cache()
    ctx = (mx.random.normal((1, key_length, taps)) * 0.1).astype(dtype)
    new = (mx.random.normal((1, new_context, taps)) * 0.1).astype(dtype)
    inner.append_context(ctx, caches)
    mx.eval([c.keys for c in caches], new)
    toks = mx.array([[5] * block], dtype=mx.uint32)

    def fwd() -> mx.array:
        inner.append_context(new, caches)
        h = inner(drafter.embed(toks), caches)
        drafts = mx.argmax(drafter.head(h[:, 1:block]).astype(mx.float32), axis=-1)
        mx.eval(drafts)
        for c in caches:
            c.trim(new_context)
        return drafts

    ms = timed(fwd, iters)
    mx.clear_cache()
    return round(ms, 3)


def draft_lm_ms(draft_lm: Any, key_length: int, block: int, iters: int, bucket: Optional[int] = None) -> float:
    """A draft LM's round: ``block - 1`` one-token forwards, each token the previous one's argmax."""
    cache = _filled_caches(draft_lm, key_length, bucket)
    start = mx.array([[5]], dtype=mx.uint32)

    def fwd() -> mx.array:
        y = start
        for _ in range(block - 1):
            y = mx.argmax(forward(draft_lm, y, cache, [])[0][:, -1:].astype(mx.float32), axis=-1).astype(mx.uint32)
        mx.eval(y)
        for c in cache:
            c.trim(block - 1)
        return y

    ms = timed(fwd, iters)
    mx.clear_cache()
    return round(ms, 3)


def eagle3_chain_ms(drafter: Any, key_length: int, block: int, iters: int, new_context: int = 7) -> float:
    """An EAGLE-3 round's draft: ``new_context`` committed positions fed with the target's features
    (the first draft step), then ``block - 2`` chain steps of one position, each the previous argmax."""
    model, args, dtype = drafter.model, drafter.args, drafter.dtype
    caches = drafter.make_cache()
    F = args.taps * args.feature_size
    ctx = (mx.random.normal((1, key_length, F)) * 0.1).astype(dtype)
    toks = mx.array([[5] * key_length], dtype=mx.uint32)
    mx.eval(model(drafter.embed(toks), model.project(ctx), caches))
    new = (mx.random.normal((1, new_context, F)) * 0.1).astype(dtype)
    new_toks = mx.array([[7] * new_context], dtype=mx.uint32)

    def fwd() -> mx.array:
        h = model(drafter.embed(new_toks), model.project(new), caches)[:, -1:]
        y = drafter.targets[mx.argmax(model.logits(h)[:, 0].astype(mx.float32), axis=-1)]
        for _ in range(block - 2):
            h = model(drafter.embed(y[:, None]), model.carry(h), caches)
            y = drafter.targets[mx.argmax(model.logits(h)[:, 0].astype(mx.float32), axis=-1)]
        mx.eval(y)
        for c in caches:
            c.trim(new_context + block - 2)
        return y

    ms = timed(fwd, iters)
    mx.clear_cache()
    return round(ms, 3)
