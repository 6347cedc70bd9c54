"""The CUDA backends (``hooks.backend.Backend``): shape-stable caches where attention compiles per shape, or mlx-lm's
caches with the kernels routed.

Why: MLX's CUDA backend compiles attention per (query length, key length) pair on first use
(40-70 ms each, docs/gpu.md). A plain ``KVCache`` returns exactly ``offset`` keys, so every decode
step and every round meets a new key length on a fresh prompt. ``PaddedKVCache`` returns keys and
values padded up to a multiple of ``bucket`` and a boolean mask ``[N, padded]`` that hides the
padding (and the stale tail left by ``trim``), so a whole bucket of positions shares one shape;
rows of a batch merge into a ``RaggedBatchKVCache`` (plugin/cuda/ragged_cache.py: each row at its own length,
keys padded the same way, a ragged commit moves nothing). ``ShapeStablePolicy.prewarm`` runs the model once per
(query width, bucket) at load, and ``verify_width`` rounds a round's verify forward up to a power of two so that
adaptive block sizes reuse those shapes. Everything CUDA-specific about caches lives here: the cache classes, their
transaction handlers, verify widths and pre-warming; drafters make their own attention caches
through ``kv_cache()`` (given to them as ``DraftBackend.kv_cache``).

Exactness: the padded keys are masked out, so they get exactly zero weight after the softmax;
the real positions see the same keys, values and causal rule as with ``KVCache`` (the CPU tests
compare tokens with ``KVCache`` through plain decoding and the round loop). The extra verify
positions come after the real ones, so causal attention keeps them out of the real rows; the
cache transaction trims them like rejected drafts.

Masks are described to the cache that makes them (``hooks.attention.describe``: key length, offset,
left padding), so that the short-query attention kernel (``plugin/cuda/attention.py``) applies them from those
bounds without reading them; the kernel reads only the real keys of the padded buffer. The policies carry that
dispatcher (``attention``) where ``MLX_SPEC_ATTENTION_KERNEL`` resolves on; ``RoutedPolicy`` is
mlx-lm's caches with it (``MLX_SPEC_PADDED_CACHE=off`` on CUDA), the kernel then taking every 2..32-query
call it can at any key length. Measured on the H200 (Llama-3-8B shape, DFlash at oracle tau 6.5, prompts
near 512-8192; docs/benchmarks.md): that matches the padded caches within the machine's noise (one pair of
runs: 2.22 / 2.09 / 2.40x over mlx-lm fresh / warm / paired against 2.49 / 2.14 / 2.19x), where with the
kernel's own thresholds it fell to 0.37x fresh. The padded caches stay the default on CUDA all the same:
batches served through the routed policy, exact, ran at a third of the padded caches' rate (97.8 against
281.8 tok/s, 8 clients), and the calls the kernel does not take (sliding windows, quantized caches, sinks,
other head dims) would still compile per shape in MLX. Both policies also carry the projection dispatcher
(``projections``, plugin/cuda/projections.py: verify-width matmuls in one launch) where ``MLX_SPEC_PROJECTION_KERNEL``
resolves on; ``RoutedPolicy`` is made for either dispatcher alone.

Per backend (``mode="auto"``): on for CUDA, off for CPU and Metal. The CPU has no per-shape
compile cost, so padding would only add attention work. Metal compiles its attention kernels per
dtype/head size, not per key length, and mlx-lm's own decoding is fast there with exact lengths;
padding would add up to ``bucket - 1`` masked keys per step and switch the one-token step from the
mask-free vector kernel to the masked one, which can only cost time. Not measured here (no Apple
GPU): ``MLX_SPEC_PADDED_CACHE=on`` turns it on anywhere. The policy applies while speculative
decoding is attached to the target; plain decoding keeps mlx-lm's caches.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from ...hooks.api import BatchTrimHandler, CachePolicy, MaskSpec, TrimHandler, describe, forward, knobs, zeroed
from . import padded_on
from .attention import ROUTED_MIN_KEYS, Dispatcher, dispatcher_for
from .compiled import CompiledForward
from .compiled import forward_for as compiled_for
from .projections import Projections, projections_for
from .ragged_cache import RaggedBatchKVCache

DEFAULT_BUCKET = 256
DEFAULT_WIDTHS = (1, 2, 4, 8, 16)
DEFAULT_PREWARM_TOKENS = 4096
BATCH_ROWS = 32  # the most rows one projection-kernel launch takes (plugin/cuda/cuda_matmul.py MAX_ROWS)


class PaddedKVCache(KVCache):
    """A ``KVCache`` whose fetched keys/values are padded to a multiple of ``bucket``."""

    transaction_handler = TrimHandler()  # positions are a prefix, as in KVCache

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
        end, span = self.offset + N, self.span(self.offset + N)
        rows = mx.arange(self.offset, end)[:, None]
        cols = mx.arange(span)[None]
        # [N, span] bool; padding and stale tail are "future" positions. Described, so that an
        # attention kernel can apply it from the bounds without reading it (plugin/cuda/attention.py).
        return describe(rows >= cols, MaskSpec(N, span, 0, end, self.offset, end), self)

    def keys_and_values(self):
        span = self.span(self.offset)
        return self.keys[..., :span, :], self.values[..., :span, :]

    @classmethod
    def merge(cls, caches: List[Any]) -> RaggedBatchKVCache:
        return RaggedBatchKVCache.merge(caches)


def make_padded_cache(
    model: Any, max_kv_size: Optional[int] = None, bucket: int = DEFAULT_BUCKET, pad_steps: bool = False
) -> List[Any]:
    """The model's prompt cache with every plain ``KVCache`` replaced by a ``PaddedKVCache``.

    Other cache types (rotating, recurrent, ...) are kept as they are.
    """
    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    return [PaddedKVCache(bucket, pad_steps) if type(c) is KVCache else c for c in caches]


def pow2_width(n: int) -> int:
    """n, or the next power of two (verify and block widths on shape-stable caches)."""
    return n if n <= 1 else 1 << (n - 1).bit_length()


class ShapeStablePolicy(CachePolicy):
    """Padded caches, power-of-two verify widths and pre-warmed shapes (the CUDA backend)."""

    name = "padded"
    shape_stable = True

    def __init__(self, bucket: int = DEFAULT_BUCKET, prewarm_tokens: Optional[int] = None,
                 attention: Optional[Dispatcher] = None, projections: Optional[Projections] = None,
                 forward: Optional[CompiledForward] = None):
        if bucket < 1:
            raise ValueError(f"padded cache bucket: got {bucket}; expected a positive integer")
        self.bucket = bucket
        self.attention = attention  # the short-query kernel's dispatcher (plugin/cuda/attention.py), or None
        self.projections = projections  # the verify-width matmul's dispatcher (plugin/cuda/projections.py), or None
        self.forward = forward  # compiled verify forwards (plugin/cuda/compiled.py), or None
        self.block_size = None  # the drafter's block: the widths ``prepare`` warms
        # None: runtime.prewarm_tokens / $MLX_SPEC_PREWARM_TOKENS, else DEFAULT_PREWARM_TOKENS (hooks/knobs.py)
        self.prewarm_tokens = int(knobs.value("prewarm_tokens") if prewarm_tokens is None else prewarm_tokens)

    def make_cache(self, model: Any, max_kv_size: Optional[int] = None) -> List[Any]:
        return make_padded_cache(model, max_kv_size, self.bucket)

    @property
    def calls(self) -> Optional[CompiledForward]:
        """The compiled forward's ``call`` serves drafters' own functions over ``kv_cache``'s caches too."""
        return self.forward if isinstance(self.forward, CompiledForward) else None

    def kv_cache(self) -> PaddedKVCache:
        """A drafter's own attention cache."""
        return PaddedKVCache(self.bucket)

    def verify_width(self, n: int) -> int:
        return pow2_width(n)

    @staticmethod
    def widths(block_size: int) -> List[int]:
        """The verify widths rounds of ``block_size`` positions meet: 1, 2, 4, .. up to its power of two."""
        return [1 << i for i in range(pow2_width(max(2, block_size)).bit_length())]

    def prepare(self, model: Any) -> None:
        """The host applied the policy (attention routed): warm the shapes rounds will meet."""
        self.prewarm(model, self.block_size)

    def prewarm(self, model: Any, block_size: Optional[int], default_block: int = 16) -> int:
        """One forward per (query width, key bucket) up to ``prewarm_tokens`` keys, so that rounds
        meet no attention shape for the first time. Returns the number of forwards."""
        widths = self.widths(block_size or default_block)
        runs = prewarm(model, self.prewarm_tokens, widths, self.bucket)
        if self.calls is not None:
            runs += prewarm_compiled(model, self.calls, self.prewarm_tokens, widths, self.capture_layers)
        return runs


class RoutedKVCache(KVCache):
    """mlx-lm's ``KVCache`` (exact key lengths, "causal" masks) whose rows merge into ``DescribedBatchKVCache``."""

    transaction_handler = TrimHandler()

    @classmethod
    def merge(cls, caches: List[Any]) -> "DescribedBatchKVCache":
        return DescribedBatchKVCache.merge(caches)


class DescribedBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` whose masks are described (``MaskSpec``), so that the kernel applies them
    from their bounds: batched rounds then compile nothing per key length either."""

    transaction_handler = BatchTrimHandler()

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:
        mask = super().make_mask(N, return_array=return_array, **kwargs)  # [B, 1, N, idx + N]
        if kwargs.get("window_size") is not None or not isinstance(mask, mx.array):
            return mask
        start = self._idx  # rows are positions idx..idx+N-1 of the batch's index; left padding hidden
        return describe(mask, MaskSpec(N, start + N, self.left_padding, start + N, start, start + N), self)

    @classmethod
    def merge(cls, caches: List[Any]) -> "DescribedBatchKVCache":
        merged = BatchKVCache.merge(caches)  # mlx-lm's (an empty batch comes back as its own class)
        out = cls([0] * len(caches))
        out.state = merged.state
        return out

    def extract(self, idx: int) -> RoutedKVCache:
        plain = super().extract(idx)
        cache = RoutedKVCache()
        cache.keys, cache.values, cache.offset = plain.keys, plain.values, plain.offset
        return cache


class RoutedPolicy(CachePolicy):
    """mlx-lm's caches with the attention kernel routed (``MLX_SPEC_PADDED_CACHE=off`` on CUDA): exact key
    lengths, single rows passing "causal" and batches described masks, the kernel taking every 2..32-query
    call at any key length (``ROUTED_MIN_KEYS``)."""

    name = "mlx-lm+attention"

    def __init__(self, attention: Optional[Dispatcher], projections: Optional[Projections] = None):
        self.attention = attention
        self.projections = projections

    def make_cache(self, model: Any, max_kv_size: Optional[int] = None) -> List[Any]:
        caches = make_prompt_cache(model, max_kv_size=max_kv_size)
        return [RoutedKVCache() if type(c) is KVCache else c for c in caches]


def policy_for(mode: Optional[str] = None, attention_mode: Optional[str] = None) -> Optional[CachePolicy]:
    """The shape-stable policy where the mode (``MLX_SPEC_PADDED_CACHE``) says so, carrying the attention
    dispatcher where ``MLX_SPEC_ATTENTION_KERNEL`` (``attention_mode``) says so and the projection dispatcher
    where ``MLX_SPEC_PROJECTION_KERNEL`` says so, and compiled verify forwards (plugin/cuda/compiled.py) where
    ``MLX_SPEC_COMPILED_FORWARD`` says so; None: mlx-lm's caches, attention and matmuls. The plugin asks through
    ``plugin.cuda.backend_for``, which imports this module only where one of them may be on."""
    if padded_on(mode):
        return ShapeStablePolicy(attention=dispatcher_for(attention_mode), projections=projections_for(),
                                 forward=compiled_for(PaddedKVCache))
    attention = dispatcher_for(attention_mode, min_keys=ROUTED_MIN_KEYS)
    projections = projections_for()
    return RoutedPolicy(attention, projections) if attention is not None or projections is not None else None


def prewarm(
    model: Any, max_tokens: int = DEFAULT_PREWARM_TOKENS, widths: Iterable[int] = DEFAULT_WIDTHS,
    bucket: int = DEFAULT_BUCKET,
) -> int:
    """Run one forward per (query width, key bucket) up to ``max_tokens`` keys so that no new
    attention shape is met while decoding. Returns the number of forwards."""
    caches = make_padded_cache(model, bucket=bucket)
    padded = [c for c in caches if isinstance(c, PaddedKVCache)]
    if not padded or max_tokens <= 0:
        return 0
    forward(model, mx.zeros((1, 1), dtype=mx.uint32), caches, [])  # learn each layer's K/V shapes
    mx.eval([c.keys for c in padded])
    shapes = [(c.keys.shape, c.values.shape, c.keys.dtype) for c in padded]
    others = [c for c in caches if not isinstance(c, PaddedKVCache)]
    runs = 0
    # A batch's verify multiplies rows x width positions in one projection launch: up to BATCH_ROWS rows take the
    # kernel's plans for 17..32 rows, other templates than one row's blocks of <= 16 use. One forward of that many
    # positions compiles them here (on an H100, a batch's first round otherwise stalled ~3 s compiling them).
    extra = [] if BATCH_ROWS in set(widths) else [BATCH_ROWS]
    for span in range(bucket, -(-max(bucket, max_tokens) // bucket) * bucket + 1, bucket):
        for q in sorted(set(widths)) + (extra if span == bucket * -(-BATCH_ROWS // bucket) else []):
            if q > span or (q == 1 and not padded[0].pad_steps):
                continue  # one-token steps keep exact lengths: nothing to warm
            if others:  # mixed caches: only reachable shapes, from a fresh cache each time
                caches = make_padded_cache(model, bucket=bucket)
                padded = [c for c in caches if isinstance(c, PaddedKVCache)]
            zeroed(padded, shapes, span, span - q)
            mx.eval(forward(model, mx.zeros((1, q), dtype=mx.uint32), caches, [])[0])
            runs += 1
    mx.clear_cache()
    return runs


def prewarm_compiled(model: Any, fwd: CompiledForward, max_tokens: int, widths: Iterable[int], layers: Sequence[int] = ()) -> int:
    """Trace ``fwd`` (plugin/cuda/compiled.py's ``CompiledForward``) for every (width, buffer length) up to
    ``max_tokens`` positions, capturing ``layers`` (tapped already), so that requests meet no trace there.
    Returns the number of forwards; none where the model's caches are not all padded ones."""
    caches = make_padded_cache(model)
    if max_tokens <= 0 or any(type(c) is not PaddedKVCache for c in caches):
        return 0
    forward(model, mx.zeros((1, 1), dtype=mx.uint32), caches, [])  # learn each layer's K/V shapes
    shapes = [(c.keys.shape, c.values.shape, c.keys.dtype) for c in caches]
    runs = 0
    for length in range(fwd.grow, -(-max(fwd.grow, max_tokens) // fwd.grow) * fwd.grow + 1, fwd.grow):
        for q in sorted(w for w in set(widths) if w in fwd.widths and w <= length):
            zeroed(caches, shapes, length, length - q)
            got = fwd(model, mx.zeros((1, q), dtype=mx.uint32), caches, list(layers))
            if got is None:  # declined or failed: the plain forward serves this model
                return runs
            mx.eval(got[0])
            runs += 1
    mx.clear_cache()
    return runs
