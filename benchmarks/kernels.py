"""Bare forward costs, timed alone: what a round costs with no machinery at all.

A round is one drafter call and one target forward over the block, one after the other (the
verify needs the drafts). Timed warm and synchronised at a prompt's key length, they give what a
round loop with no machinery reaches: ``kernel bound = tau * T(one-token step) / (T(draft) +
T(verify))``, and with a drafter that costs nothing, ``verify ceiling = tau * T(one-token step) /
T(verify)``. ``mlx-spec bench`` times them at each prompt's key length (``prompt_key_lengths``) and
at longer ones (``--cost-keys``), and reports both beside the measured speed-ups;
bench/verify_cost.py breaks the forwards down.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..hooks.api import forward
from ..plugin.cuda import backend as cuda_backend


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
    cache = cuda_backend.make_padded_cache(model, bucket=bucket) if bucket else make_prompt_cache(model)
    prompt = mx.array([[2 + i % 250 for i in range(key_length)]], dtype=mx.uint32)  # ids any vocabulary has
    for i in range(0, key_length, 512):
        mx.eval(forward(model, prompt[:, i:i + 512], cache, [])[0][:, -1])
    return cache


Graph = Tuple[Callable[[], mx.array], Callable[[], None]]  # (build the forward's graph, undo its cache writes)


def target_step(model: Any, cache: List[Any], n: int, policy_forward: Optional[Callable[..., Any]] = None) -> Graph:
    """A forward over ``n`` positions after the cache's and its log-softmax rows ([n, V]); undo trims them.
    ``policy_forward``: a cache policy's forward (plugin/cuda/compiled.py), tried first as the round's verify does."""
    toks = mx.array([[3 + (i % 50) for i in range(n)]], dtype=mx.uint32)

    def build() -> mx.array:
        got = policy_forward(model, toks, cache, []) if policy_forward is not None else None
        logits = (got or forward(model, toks, cache, []))[0][0].astype(mx.float32)  # [n, V]
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def undo() -> None:
        for c in cache:
            c.trim(n)

    return build, undo


def target_forward_ms(model: Any, key_length: int, widths: List[int], iters: int,
                      bucket: Optional[int] = None, policy_forward: Optional[Callable[..., Any]] = None
                      ) -> Dict[int, Dict[str, float]]:
    """width -> {"ms": forward + its log-softmax rows, "build_ms": the graph built on the CPU},
    after ``key_length`` cached positions (a padded cache when ``bucket``)."""
    cache = _filled_caches(model, key_length, bucket)
    out: Dict[int, Dict[str, float]] = {}
    for n in widths:
        build, undo = target_step(model, cache, n, policy_forward)
        builds: List[float] = []

        def fwd() -> mx.array:
            t = time.perf_counter()
            logprobs = build()
            builds.append((time.perf_counter() - t) * 1e3)
            mx.eval(logprobs)
            undo()
            return logprobs

        ms = timed(fwd, iters)
        out[n] = {"ms": round(ms, 3), "build_ms": round(statistics.median(builds), 3)}
    mx.clear_cache()
    return out


def dflash_block_ms(drafter: Any, key_length: int, block: int, iters: int, new_context: int = 7) -> float:
    """One block of ``dflash_blocks_ms`` (bench/verify_cost.py, bench/attention_forwards.py)."""
    return dflash_blocks_ms(drafter, key_length, [block], iters, new_context)[block]


def dflash_context(drafter: Any, key_length: int, new_context: int = 7) -> Tuple[List[Any], mx.array]:
    """The drafter's context caches filled with ``key_length`` positions, and ``new_context`` positions of
    target features to append per round ([1, new_context, taps*H])."""
    inner = drafter.model
    dtype = inner.norm.weight.dtype
    taps = len(inner.args.target_layer_ids) * inner.args.hidden_size
    caches = drafter.make_cache()
    ctx = (mx.random.normal((1, key_length, taps)) * 0.1).astype(dtype)
    new = (mx.random.normal((1, new_context, taps)) * 0.1).astype(dtype)
    inner.append_context(ctx, caches)
    mx.eval([c.keys for c in caches], new)
    return caches, new


def dflash_round(drafter: Any, caches: List[Any], new: mx.array, block: int) -> Graph:
    """A DFlash round's draft as a greedy round makes it ([1, block - 1]). Drafting ahead (the default where the
    policy compiles the drafter's calls): one call writes a verify's ``block`` positions of features past the
    context, the first ``new``'s count of them kept (as if accepted), runs the block past those and takes the
    head's argmax; the offsets stay, so undo has nothing to do. Elsewhere: ``new`` appended, the block, the
    head's argmax; undo trims the appended context."""
    toks = mx.array([[5] * block], dtype=mx.uint32)
    n = new.shape[1]
    if drafter.compiler is not None:
        kept = min(n, block)
        feats = mx.concatenate([new[:, :kept], mx.zeros((1, block - kept, new.shape[2]), new.dtype)], axis=1)
        shift = mx.array(kept, dtype=mx.int32)
        mx.eval(feats, shift)
        drafts = drafter.draft(caches, toks, None, feats, shift)
        if drafts is not None:  # traced and run once: the policy takes these caches
            mx.eval(drafts)
            return lambda: drafter.draft(caches, toks, None, feats, shift), lambda: None

    def build() -> mx.array:
        drafter.append_context(caches, new)
        h = drafter.block(caches, toks)
        return mx.argmax(drafter.head(h[:, 1:block]).astype(mx.float32), axis=-1)

    def undo() -> None:
        for c in caches:
            c.trim(n)

    return build, undo


def dflash_blocks_ms(drafter: Any, key_length: int, blocks: Sequence[int], iters: int,
                     new_context: int = 7) -> Dict[int, float]:
    """block -> a DFlash round's draft (``dflash_round``): ``new_context`` new context positions (tau ~6.5
    accepted last round) and the block through the drafter, then the shared head's argmax. One context fill."""
    caches, new = dflash_context(drafter, key_length, new_context)
    out: Dict[int, float] = {}
    for block in blocks:
        build, undo = dflash_round(drafter, caches, new, block)

        def fwd() -> mx.array:
            drafts = build()
            mx.eval(drafts)
            undo()
            return drafts

        out[block] = round(timed(fwd, iters), 3)
    mx.clear_cache()
    return out


def draft_lm_ms(draft_lm: Any, key_length: int, blocks: Sequence[int], iters: int,
                bucket: Optional[int] = None) -> Dict[int, float]:
    """block -> a draft LM's round: ``block - 1`` one-token forwards, each token the previous one's argmax."""
    cache = _filled_caches(draft_lm, key_length, bucket)
    start = mx.array([[5]], dtype=mx.uint32)
    out: Dict[int, float] = {}
    for block in blocks:

        def fwd() -> mx.array:
            y = start
            for _ in range(block - 1):
                y = mx.argmax(forward(draft_lm, y, cache, [])[0][:, -1:].astype(mx.float32), axis=-1).astype(mx.uint32)
            mx.eval(y)
            for c in cache:
                c.trim(block - 1)
            return y

        out[block] = round(timed(fwd, iters), 3)
    mx.clear_cache()
    return out


def eagle3_chain_ms(drafter: Any, key_length: int, blocks: Sequence[int], iters: int,
                    new_context: int = 7) -> Dict[int, float]:
    """block -> an EAGLE-3 round's draft: ``new_context`` committed positions fed with the target's
    features (the first draft step), then ``block - 2`` chain steps of one position, each the previous argmax."""
    model, args, dtype = drafter.model, drafter.args, drafter.dtype
    caches = drafter.make_cache()
    F = args.taps * args.feature_size
    ctx = (mx.random.normal((1, key_length, F)) * 0.1).astype(dtype)
    toks = mx.array([[5] * key_length], dtype=mx.uint32)
    for i in range(0, key_length, 512):  # chunks: a causal mask over 16k queries at once would not fit
        mx.eval(model(drafter.embed(toks[:, i:i + 512]), model.project(ctx[:, i:i + 512]), caches))
    new = (mx.random.normal((1, new_context, F)) * 0.1).astype(dtype)
    new_toks = mx.array([[7] * new_context], dtype=mx.uint32)
    out: Dict[int, float] = {}
    for block in blocks:

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

        out[block] = round(timed(fwd, iters), 3)
    mx.clear_cache()
    return out


# -- the bench's kernel costs ---------------------------------------------------------------------

KEY_ROUND = 256  # run key lengths are rounded up to this: prompts of similar length share their timings
EXTRA_KEYS_CUDA = [8192, 16384]  # the default longer key lengths on CUDA (none elsewhere)


def prompt_key_lengths(lengths: List[List[int]], max_tokens: int) -> List[int]:
    """Per prompt (base index of ``lengths`` [prompts][methods]): the key length at mid-decode of its
    median method's prompt, rounded up to ``KEY_ROUND``."""
    mid = [statistics.median_low(row) + max_tokens // 2 for row in lengths]
    return [-(-k // KEY_ROUND) * KEY_ROUND for k in mid]


def kernel_costs(model: Any, drafters: Dict[str, Any], methods: List[Any], run_keys: List[int],
                 extra_keys: List[int], bucket: Optional[int], iters: int = 10,
                 on_progress: Callable[[str], None] = lambda msg: None,
                 policy_forward: Optional[Callable[..., Any]] = None) -> Dict[str, Any]:
    """Bare, warm, synchronised forward costs at every key length of ``run_keys`` and ``extra_keys``:
    the target over 1, 16, 32 positions and each block, and each drafter's blocks. ``bucket``: padded
    caches; ``policy_forward``: the cache policy's forward for the target (compiled verify forwards). The
    top-level fields repeat the median run key length's."""
    spec = [m for m in methods if m.family == "spec" and m.block]
    widths = sorted({1, 16, 32} | {m.block for m in spec})
    kinds = {k: sorted({m.block for m in spec if m.kind == k}) for k in sorted({m.kind for m in spec}) if k in drafters}
    by_key: Dict[str, Dict[str, Any]] = {}
    keys = sorted(set(run_keys) | set(extra_keys))
    for i, L in enumerate(keys):
        on_progress(f"bare forward costs (kernel bound) {i + 1}/{len(keys)}: {L} keys")
        target_ms = target_forward_ms(model, L, widths, iters, bucket, policy_forward)  # one cache fill for every width
        draft_ms: Dict[str, Dict[int, float]] = {}
        for kind, blocks in kinds.items():
            drafter, draft_lm, _ = drafters[kind]
            if kind == "dflash":
                draft_ms[kind] = dflash_blocks_ms(drafter, L, blocks, iters)
            elif kind == "eagle3":
                draft_ms[kind] = eagle3_chain_ms(drafter, L, blocks, iters)
            elif kind == "draft_model" and draft_lm is not None:
                draft_ms[kind] = draft_lm_ms(draft_lm, L, blocks, iters, bucket)
        by_key[str(L)] = {"target_forward_ms": {str(w): v["ms"] for w, v in target_ms.items()},
                          "target_graph_build_ms": {str(w): v["build_ms"] for w, v in target_ms.items()},
                          "draft_ms": {k: {str(b): ms for b, ms in v.items()} for k, v in draft_ms.items()}}
    run = sorted(set(run_keys))
    median = run[len(run) // 2]
    return {"key_length": median, "cache": "padded" if bucket else "KVCache", "iters": iters, **by_key[str(median)],
            "by_key_length": by_key, "run_key_lengths": run, "extra_key_lengths": sorted(set(extra_keys))}
