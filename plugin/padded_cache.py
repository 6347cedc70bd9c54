"""Shape-stable KV caches: key lengths padded to buckets, with an array mask made by the cache.

Why: MLX's CUDA backend compiles attention per (query length, key length) pair on first use
(40-70 ms each, DESIGN.md). A plain ``KVCache`` returns exactly ``offset`` keys, so every decode
step and every round meets a new key length on a fresh prompt. ``PaddedKVCache`` returns keys and
values padded up to a multiple of ``bucket`` and a boolean mask ``[N, padded]`` that hides the
padding (and the stale tail left by ``trim``), so a whole bucket of positions shares one shape.
``prewarm`` runs the model once per (query width, bucket) at load, and ``verify_width`` rounds a
round's verify forward up to a power of two so that adaptive block sizes reuse those shapes too.

Exactness: the padded keys are masked out, so they get exactly zero weight after the softmax;
the real positions see the same keys, values and causal rule as with ``KVCache`` (the CPU tests
compare tokens with ``KVCache`` through plain decoding and through the round loop). The extra
verify positions come after the real ones, so causal attention keeps them out of the real rows;
the cache transaction trims them like rejected drafts.

Per backend (``mode="auto"``): on for CUDA, off for CPU and Metal. The CPU has no per-shape
compile cost, so padding would only add attention work. Metal compiles its attention kernels per
dtype/head size, not per key length, and mlx-lm's own decoding is fast there with exact lengths;
padding would add up to ``bucket - 1`` masked keys per step and switch the one-token step from the
mask-free vector kernel to the masked one, which can only cost time. Not measured here (no Apple
GPU): ``MLX_SPEC_PADDED_CACHE=on`` turns it on anywhere.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from . import commit

DEFAULT_BUCKET = 256
DEFAULT_WIDTHS = (1, 2, 4, 8, 16)
DEFAULT_PREWARM_TOKENS = 4096
ENV = "MLX_SPEC_PADDED_CACHE"
MODES = ("auto", "on", "off")
FACTORY_KEY = "cache_factory"  # LoadedTarget.attachments key the host reads to make caches


class PaddedKVCache(KVCache):
    """A ``KVCache`` whose fetched keys/values are padded to a multiple of ``bucket``."""

    def __init__(self, bucket: int = DEFAULT_BUCKET, pad_steps: bool = False):
        super().__init__()
        # One-token steps keep exact lengths by default: measured on the H200, the masked kernel
        # cost more (~13% of plain decoding) than new key lengths do for one-token queries.
        self.pad_steps = pad_steps
        if bucket < 1:
            raise ValueError(f"PaddedKVCache bucket: got {bucket}; expected a positive integer")
        self.bucket = bucket

    def span(self, end: int) -> int:
        """Padded key length for ``end`` real positions."""
        return max(1, -(-end // self.bucket)) * self.bucket

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev = self.offset
        end = prev + keys.shape[2]  # keys: [B, H, N, D]
        span = self.span(end)
        exact = keys.shape[2] == 1 and not self.pad_steps
        if self.keys is None or span > self.keys.shape[2]:
            B, H, _, Dk = keys.shape
            Dv = values.shape[3]
            have = 0 if self.keys is None else self.keys.shape[2]
            new_k = mx.zeros((B, H, span - have, Dk), keys.dtype)
            new_v = mx.zeros((B, H, span - have, Dv), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
        self.offset = end
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        if exact:  # one-token step: exact length, no mask (the fast vector kernel)
            return self.keys[..., :end, :], self.values[..., :end, :]
        if span == self.keys.shape[2]:
            return self.keys, self.values
        return self.keys[..., :span, :], self.values[..., :span, :]  # [B, H, span, D]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        if window_size is not None:
            raise ValueError("PaddedKVCache does not support sliding-window attention; use the model's own cache")
        if N == 1 and not self.pad_steps:
            return None
        # Called before update_and_fetch: rows are positions offset..offset+N-1.
        rows = mx.arange(self.offset, self.offset + N)[:, None]
        cols = mx.arange(self.span(self.offset + N))[None]
        return rows >= cols  # [N, span] bool; padding and stale tail are "future" positions

    def keys_and_values(self):
        span = self.span(self.offset)
        return self.keys[..., :span, :], self.values[..., :span, :]


class _PaddedTrimHandler:
    """Cache transaction for ``PaddedKVCache``: the positions are a prefix, drop the tail with ``trim``."""

    def begin(self, cache: PaddedKVCache) -> int:
        return cache.offset

    def commit(self, cache: PaddedKVCache, start: int, n: int) -> None:
        written = cache.offset - start
        assert 0 <= n <= written, (n, written)
        cache.trim(written - n)

    def abort(self, cache: PaddedKVCache, start: int) -> None:
        cache.trim(cache.offset - start)


commit.HANDLERS[PaddedKVCache] = _PaddedTrimHandler()


def make_padded_cache(
    model: Any, max_kv_size: Optional[int] = None, bucket: int = DEFAULT_BUCKET, pad_steps: bool = False
) -> List[Any]:
    """The model's prompt cache with every plain ``KVCache`` replaced by a ``PaddedKVCache``.

    Other cache types (rotating, recurrent, ...) are kept as they are.
    """
    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    return [PaddedKVCache(bucket, pad_steps) if type(c) is KVCache else c for c in caches]


def is_padded(caches: Sequence[Any]) -> bool:
    return bool(caches) and any(isinstance(c, PaddedKVCache) for c in caches)


def verify_width(caches: Sequence[Any], n: int) -> int:
    """Positions to feed for a verify forward of ``n`` real positions: n, or the next power of two."""
    if n <= 1 or not is_padded(caches):
        return n
    return 1 << (n - 1).bit_length()


def backend() -> str:
    """'cuda', 'metal' or 'cpu': where the default device runs."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return "cpu"
    try:
        if mx.cuda.is_available():
            return "cuda"
    except AttributeError:
        pass
    return "metal" if mx.metal.is_available() else "gpu"


def resolve_mode(mode: Optional[str] = None) -> bool:
    """Whether padded caches are on: ``mode`` (or $MLX_SPEC_PADDED_CACHE), 'auto' = CUDA only."""
    mode = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if mode not in MODES:
        raise ValueError(f"{ENV}: got {mode!r}; allowed: {', '.join(MODES)}")
    if mode == "auto":
        return backend() not in ("cpu", "metal")
    return mode == "on"


def prewarm(
    model: Any, max_tokens: int = DEFAULT_PREWARM_TOKENS, widths: Iterable[int] = DEFAULT_WIDTHS,
    bucket: int = DEFAULT_BUCKET,
) -> int:
    """Run one forward per (query width, key bucket) up to ``max_tokens`` keys so that no new
    attention shape is met while decoding. Returns the number of forwards."""
    caches = make_padded_cache(model, bucket=bucket)
    padded = [c for c in caches if isinstance(c, PaddedKVCache)]
    if not padded:
        return 0
    model(mx.zeros((1, 1), dtype=mx.uint32), cache=caches)  # learn each layer's K/V shapes
    mx.eval([c.keys for c in padded])
    shapes = [(c.keys.shape, c.values.shape, c.keys.dtype) for c in padded]
    others = [c for c in caches if not isinstance(c, PaddedKVCache)]
    runs = 0
    for span in range(bucket, -(-max(bucket, max_tokens) // bucket) * bucket + 1, bucket):
        for q in sorted(set(widths)):
            if q > span or (q == 1 and not padded[0].pad_steps):
                continue  # one-token steps keep exact lengths: nothing to warm
            if others:  # mixed caches: only reachable shapes, from a fresh cache each time
                caches = make_padded_cache(model, bucket=bucket)
                padded = [c for c in caches if isinstance(c, PaddedKVCache)]
            for c, (ks, vs, dt) in zip(padded, shapes):
                c.keys = mx.zeros((ks[0], ks[1], span, ks[3]), dt)
                c.values = mx.zeros((vs[0], vs[1], span, vs[3]), dt)
                c.offset = span - q
            out = model(mx.zeros((1, q), dtype=mx.uint32), cache=caches)
            mx.eval(out)
            runs += 1
    mx.clear_cache()
    return runs


def install(
    target: Any, mode: Optional[str] = None, prewarm_tokens: Optional[int] = None,
    widths: Iterable[int] = DEFAULT_WIDTHS, bucket: int = DEFAULT_BUCKET,
) -> bool:
    """Make the host build padded caches for ``target`` (when the mode says so) and pre-warm them.

    Sets ``target.attachments['cache_factory']``, which the host's ``new_state`` uses.
    """
    if not resolve_mode(mode):
        target.attachments.pop(FACTORY_KEY, None)
        return False
    factory: Callable[..., List[Any]] = lambda model, max_kv_size=None: make_padded_cache(model, max_kv_size, bucket)
    target.attachments[FACTORY_KEY] = factory
    n = prewarm_tokens if prewarm_tokens is not None else int(os.environ.get("MLX_SPEC_PREWARM_TOKENS", DEFAULT_PREWARM_TOKENS))
    if n > 0:
        prewarm(target.model, n, widths, bucket)
    return True


def widths_for(block_size: Optional[int], default_block: int = 16) -> List[int]:
    """Query widths to pre-warm for rounds of up to ``block_size`` positions (plus the 1-token step)."""
    top = verify_width([PaddedKVCache()], max(2, block_size or default_block))
    return [1 << i for i in range(top.bit_length())]
