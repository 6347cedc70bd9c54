"""The committed K/V of a target's attention caches, as a drafter attends over them (shared K/V).

Some drafters keep no attention cache of their own and attend over the target's (the Gemma 4
assistant reads the K/V of the target's last full- and sliding-attention layers). mlx-lm's caches
store keys in layouts of their own: a prefix (``KVCache``), left-padded rows (``BatchKVCache``),
a ring buffer that may have wrapped (``RotatingKVCache``, ``BatchRotatingKVCache``). ``committed_kv``
hands the stored arrays over as they are, with the token position each slot holds, so that a
reader masks by position (attention does not care about the order of its keys) and nothing is
copied or reordered. It only reads: the cache is not changed.

A sliding-window cache's view holds its last ``max_size - 1`` positions (all a query at the next
position sees through a window of ``max_size``): older slots are marked -1, since after a ragged
batch commit mlx-lm's right-padding roll may leave a stale key there until the next update trims it.

Read it between steps, when the caches hold exactly the committed positions (on entry to
``host_decode_step``: every token but each row's pending one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache


@dataclass
class KVView:
    """A cache's stored K/V and the position of each slot."""

    keys: mx.array  # [B, n_kv, S, Dk] as the model stored them (normed and roped by the layer)
    values: mx.array  # [B, n_kv, S, Dv]
    positions: mx.array  # [B, S] int32: the token position slot s holds for row b; -1: none (padding, unused)

    def rows(self, index: mx.array) -> "KVView":
        """The view of these batch rows only."""
        return KVView(self.keys[index], self.values[index], self.positions[index])


SUPPORTED = ("KVCache", "BatchKVCache", "RotatingKVCache", "BatchRotatingKVCache", "RaggedBatchKVCache")


def committed_kv(cache: Any) -> Optional[KVView]:
    """The K/V ``cache`` holds and each slot's position; None while it holds nothing.

    Raises ``TypeError`` for cache types whose layout is not known here (quantized, chunked,
    recurrent), naming the supported ones.
    """
    if isinstance(cache, BatchRotatingKVCache):
        return _batch_rotating(cache)
    if isinstance(cache, RotatingKVCache):
        return _rotating(cache)
    lengths = getattr(cache, "lengths", None)
    if isinstance(lengths, tuple) and hasattr(cache, "set_lengths"):  # rows at their own lengths (plugin/cuda/ragged_cache.py)
        if cache.keys is None or max(lengths) == 0:
            return None
        n = max(lengths)
        slot = mx.arange(n, dtype=mx.int32)[None]  # [1, S]: a row's slots are its positions
        return KVView(cache.keys[..., :n, :], cache.values[..., :n, :],
                      mx.where(slot < cache.offset[:, None], slot, -1).astype(mx.int32))
    if isinstance(cache, BatchKVCache):
        if cache.keys is None or cache._idx == 0:
            return None
        n = cache._idx
        slot = mx.arange(n)[None]  # [1, S]
        pos = slot - cache.left_padding[:, None]  # [B, S]: left padding sits before position 0
        return KVView(cache.keys[..., :n, :], cache.values[..., :n, :], mx.where(pos >= 0, pos, -1).astype(mx.int32))
    if isinstance(cache, KVCache):
        if cache.keys is None or cache.offset == 0:
            return None
        n = cache.offset
        return KVView(cache.keys[..., :n, :], cache.values[..., :n, :], mx.arange(n, dtype=mx.int32)[None])
    raise TypeError(f"cannot read the committed K/V of a {type(cache).__module__}.{type(cache).__name__}; "
                    f"supported cache types: {', '.join(SUPPORTED)} (and their subclasses)")


def _ring_order(size: int, idx: int, keep: int = 0) -> mx.array:
    """[size] temporal index of each slot of a wrapped ring buffer whose next write goes to ``idx``
    (the ``keep`` first slots are never overwritten): mlx-lm's ``_temporal_order``."""
    slot = mx.arange(size)
    return mx.where(slot < keep, slot, mx.where(slot >= idx, keep + slot - idx, keep + size - idx + slot - keep))


def _rotating(cache: RotatingKVCache) -> Optional[KVView]:
    if cache.keys is None or cache.offset == 0:
        return None
    size, idx, offset, keep = cache.keys.shape[2], cache._idx, cache.offset, cache.keep
    if idx == size or idx >= offset:  # in temporal order: slots [0, idx)
        order, length = mx.arange(size), idx
    else:  # wrapped: the oldest kept position sits at idx
        order, length = _ring_order(size, idx, keep), size
    pos = mx.where(order < keep, order, offset - length + order)  # the newest slot holds offset - 1
    valid = (order < length) & (pos >= 0) & ((order < keep) | (pos >= offset - (cache.max_size - 1)))
    return KVView(cache.keys, cache.values, mx.where(valid, pos, -1).astype(mx.int32)[None])


def _batch_rotating(cache: BatchRotatingKVCache) -> Optional[KVView]:
    if cache.keys is None or cache._offset == 0:
        return None
    size, idx = cache.keys.shape[2], cache._idx
    if cache.rotated:
        order, length = _ring_order(size, idx), size
    else:
        order, length = mx.arange(size), idx
    # Rows are right-aligned in temporal order: slot t holds position offset[b] - length + t;
    # left_padding[b] counts the temporal slots before row b's first position.
    pos = cache.offset[:, None] - length + order[None]  # [B, S]
    valid = ((order[None] < length) & (order[None] >= cache.left_padding[:, None]) & (pos >= 0)
             & (pos >= cache.offset[:, None] - (cache.max_size - 1)))
    return KVView(cache.keys, cache.values, mx.where(valid, pos, -1).astype(mx.int32))
