"""The attention dispatcher the plugin hands the host: a short-query kernel where it pays, MLX's path elsewhere.

The host routes a loaded model's attention through ``CachePolicy.attention`` (hooks/attention.py), so
every call an mlx-lm attention layer makes to ``scaled_dot_product_attention`` comes here with the same
arguments. ``Dispatcher`` sends a call to its kernel (plugin/cuda/cuda_attention.py on MLX-CUDA:
``sdpa(q, k, v, scale, key_len, offset, key_start)``) only when

- the forward has ``min_queries``..``max_queries`` queries (2..32: verify forwards and drafter blocks;
  one-token steps and prefill chunks keep MLX's kernels),
- the keys and values are plain arrays (a quantized cache's tuples take mlx-lm's quantized path), no
  attention sinks, and the kernel takes the shapes and dtype (head dims 64/128/256, bf16/fp16, K and V alike),
- the mask's meaning is known without reading it: None (every key), ``"causal"`` (query i sees keys
  j <= S - L + i, MLX's rule), or an array described by the code that built it (``hooks.attention.MaskSpec``:
  the plugin's padded caches, the DFlash drafter) whose shape matches the call; key length, offset and
  left padding then come from the description, so the kernel computes the same function. The description
  travels with the cache that made the mask (``described(mask, cache)``); the later layers of a forward
  pass the same mask object with their own caches, so the dispatcher remembers the last few described
  masks it met (weak references, checked by identity: a spec holds for that very array only),
- and there are at least ``min_keys`` keys for that kind of mask, the measured crossover (below).

Everything else calls ``mlx_lm.models.base.scaled_dot_product_attention`` unchanged. ``counts`` tallies
which path each call took ("kernel", or "mlx: <reason>"); ``mlx-spec bench`` records them.

Thresholds (docs/benchmarks.md, H200, 16 queries, 32/8 heads, head dim 128): the kernel ties SDPA "causal"
at 4096 keys and wins above; against SDPA with a boolean mask (what padded and batched caches pass) it
ties at 512 keys and wins 1.9x at 4096. Hence ``min_keys`` 4096 for None / "causal", 1024 for described
arrays behind the padded caches, whose shapes MLX has compiled once. With mlx-lm's caches (exact key
lengths) every call left to MLX meets a new key length and compiles (``ROUTED_MIN_KEYS``: 0).
``MLX_SPEC_ATTENTION_MIN_KEYS`` sets both.

On by default where the kernel runs (MLX built with CUDA, GPU default device); off on CPU and Metal.
``MLX_SPEC_ATTENTION_KERNEL`` = auto | on | off overrides (on: an error where the kernel cannot run).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import weakref

import mlx.core as mx
from mlx_lm.models import base

from ...hooks.api import MaskSpec, described, knobs
from . import ATTENTION_ENV, cuda_attention, kernel_mode

ENV = ATTENTION_ENV
ENV_MIN_KEYS = "MLX_SPEC_ATTENTION_MIN_KEYS"
MIN_KEYS = {"mlx-mask": 4096, "array": 1024}  # by mask kind: None / "causal" (MLX's fast path), described arrays
# With exact key lengths (mlx-lm's caches), MLX's attention for 2..32 queries compiles per key length: on the
# H200 (bench/results/attention/h200-attention-e2e-kvcache-*) DFlash rounds at prompts near 512-8192 ran at
# 0.37x mlx-lm fresh with MIN_KEYS, 2.22x with the kernel taking every such call.
ROUTED_MIN_KEYS = {"mlx-mask": 0, "array": 0}
_MLX = base.scaled_dot_product_attention  # mlx-lm's function, as imported here (never reassigned)
RECENT_MASKS = 4  # described masks a dispatcher remembers (a forward's layers share one or two)


@dataclass(frozen=True)
class Kernel:
    """An attention kernel with ``cuda_attention.sdpa``'s contract, and what it accepts."""

    name: str
    fn: Callable[..., mx.array]  # (q [B,Hq,L,D], k, v [B,Hkv,S,D], scale, key_len, offset, key_start) -> [B,Hq,L,D]
    head_dims: Optional[Tuple[int, ...]] = cuda_attention.HEAD_DIMS  # None: any
    dtypes: Optional[Tuple[mx.Dtype, ...]] = (mx.bfloat16, mx.float16)  # None: any
    # (B, key_len, offset, key_start) -> what ``fn`` takes as ``params=``: built once per mask, shared by
    # the layers of a forward (per-row bounds are then one small device array, not one per layer).
    params: Optional[Callable[..., Any]] = None


def cuda_kernel() -> Kernel:
    return Kernel("cuda_attention.sdpa", cuda_attention.sdpa, params=cuda_attention.attention_params)


class Dispatcher:
    """``scaled_dot_product_attention`` for routed models: ``kernel`` where it is exact and pays, else MLX's."""

    def __init__(self, kernel: Kernel, min_queries: int = 2, max_queries: int = 32,
                 min_keys: Optional[Dict[str, int]] = None):
        self.kernel = kernel
        self.min_queries, self.max_queries = min_queries, max_queries
        self.min_keys = dict(MIN_KEYS if min_keys is None else min_keys)
        self.enabled = True  # False: every call takes MLX's path (the bench's on/off in one process)
        self.counts: Counter = Counter()
        self._params: Tuple[Any, ...] = (None, None, None)  # (spec, batch, params) of the last kernel call
        # (weak reference to a mask, its spec), newest first: the masks a cache described to this dispatcher
        self._recent: List[Tuple["weakref.ref[mx.array]", MaskSpec]] = []

    def __call__(self, queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                 mask: Any, sinks: Optional[mx.array] = None) -> mx.array:
        spec, why = self.plan(queries, keys, values, cache, mask, sinks)
        if spec is None:
            self.counts[f"mlx: {why}"] += 1
            return _MLX(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        self.counts["kernel"] += 1
        if self.kernel.params is None:
            return self.kernel.fn(queries, keys, values, scale, spec.key_len, spec.offset, spec.key_start)
        B = queries.shape[0]
        if self._params[0] is not spec or self._params[1] != B:  # a described mask: one spec per forward
            self._params = (spec, B, self.kernel.params(B, spec.key_len, spec.offset, spec.key_start))
        return self.kernel.fn(queries, keys, values, scale, spec.key_len, spec.offset, spec.key_start,
                              params=self._params[2])

    def plan(self, queries: mx.array, keys: Any, values: Any, cache: Any, mask: Any,
             sinks: Any) -> Tuple[Optional[MaskSpec], str]:
        """(the bounds the kernel gets, "") or (None, why MLX's path runs). Reads no array's values."""
        if not self.enabled:
            return None, "off"
        # Before any refusal: a mask described to the layer that makes it is remembered for the later layers
        # that pass it, whatever that first call's fate (the same choices as a description on the array).
        found = self.described(mask, cache)
        L = queries.shape[-2] if queries.ndim == 4 else 0
        if not self.min_queries <= L <= self.max_queries:
            return None, "queries"
        if hasattr(cache, "bits") or not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            return None, "quantized"
        if sinks is not None:
            return None, "sinks"
        B, Hq, _, D = queries.shape
        if keys.ndim != 4 or values.shape != keys.shape or keys.shape[0] != B or keys.shape[3] != D \
                or Hq % keys.shape[1] != 0:
            return None, "shapes"
        k = self.kernel
        if k.dtypes is not None and not (queries.dtype in k.dtypes and keys.dtype == values.dtype == queries.dtype):
            return None, "dtype"
        if k.head_dims is not None and D not in k.head_dims:
            return None, "head dim"
        spec = mask_bounds(mask, B, L, keys.shape[2], found)
        if spec is None:
            return None, "mask"
        if spec.keys < self.min_keys["array" if spec.kind == "array" else "mlx-mask"]:
            return None, "keys"
        return spec, ""

    def described(self, mask: Any, cache: Any) -> Optional[MaskSpec]:
        """The spec of this very mask array: recorded by ``cache`` (the layer whose cache made it), or by the
        cache of an earlier call that passed it (a forward's later layers pass it with their own caches)."""
        if not isinstance(mask, mx.array):
            return None
        spec = described(mask, cache)
        recent = self._recent
        for i, (ref, seen) in enumerate(recent):
            if ref() is mask:
                if spec is None or spec is seen:
                    return seen
                del recent[i]  # described anew (the same array, another spec): the cache's record holds
                break
        if spec is not None:
            recent.insert(0, (weakref.ref(mask), spec))
            del recent[RECENT_MASKS:]
        return spec

    def report(self) -> Dict[str, Any]:
        total = sum(self.counts.values())
        return {"kernel": self.kernel.name, "enabled": self.enabled, "min_keys": dict(self.min_keys),
                "queries": [self.min_queries, self.max_queries], "calls": dict(self.counts),
                "kernel_share": round(self.counts["kernel"] / total, 4) if total else None}


def _fits(x: Any, B: int) -> bool:
    return isinstance(x, int) or (isinstance(x, mx.array) and x.ndim <= 1 and (x.ndim == 0 or x.shape[0] in (1, B)))


def mask_bounds(mask: Any, B: int, L: int, S: int, spec: Optional[MaskSpec] = None) -> Optional[MaskSpec]:
    """The bounds equal to ``mask`` for L queries over S keys, or None when not known without reading it.
    ``spec``: an array mask's description (``Dispatcher.described``), None for an undescribed one."""
    if mask is None:
        return MaskSpec(L, S, 0, S, S, S, kind="none")
    if isinstance(mask, str):
        # MLX's "causal": queries at the end of the keys. Fewer keys than queries would leave rows empty.
        return MaskSpec(L, S, 0, S, S - L, S, kind="causal") if mask == "causal" and S >= L else None
    # an array: its description's shape ends in (queries, span), checked when it was described
    if spec is None or spec.span != S or (mask.ndim == 4 and mask.shape[0] not in (1, B)):
        return None
    # One row broadcast over the queries holds for every query only when nothing is cut causally.
    broadcast = spec.queries == 1 and isinstance(spec.offset, int) and spec.offset >= spec.keys - 1
    if spec.queries != L and not broadcast:
        return None
    if not all(_fits(x, B) for x in (spec.key_start, spec.key_len, spec.offset)):
        return None
    return spec


def resolve_mode(mode: Optional[str] = None, source: str = ENV) -> bool:
    """Whether the dispatcher is on: ``mode`` (or $MLX_SPEC_ATTENTION_KERNEL); auto = where the kernel runs.
    ``source`` names the setting in messages."""
    return kernel_mode(mode, "attention_kernel", source, "the attention kernel")


def min_keys_from_env() -> Optional[Dict[str, int]]:
    """Both thresholds from ``runtime.attention_min_keys`` / $MLX_SPEC_ATTENTION_MIN_KEYS (hooks/knobs.py), or None."""
    n = knobs.value("attention_min_keys")
    return None if n is None else {kind: n for kind in MIN_KEYS}


def dispatcher_for(mode: Optional[str] = None, source: str = ENV,
                   min_keys: Optional[Dict[str, int]] = None) -> Optional[Dispatcher]:
    """The CUDA kernel's dispatcher where the mode says so, else None (mlx-lm's attention). Thresholds:
    $MLX_SPEC_ATTENTION_MIN_KEYS, else ``min_keys``, else ``MIN_KEYS``."""
    if not resolve_mode(mode, source):
        return None
    return Dispatcher(cuda_kernel(), min_keys=min_keys_from_env() or min_keys)
