"""Rows of a batch at their own lengths: the shape-stable policy's batched cache (``RaggedBatchKVCache``).

Why: mlx-lm's ``BatchKVCache`` left-pads rows to one shared write index. A speculative round keeps a
different count per row, so every ragged commit rolls each shorter row right by what it rejected
(``finalize``'s ``dynamic_roll``: a copy of every layer's whole K/V buffer, every round), and the shared
index makes the keys' length, and so MLX's attention shapes, change every step. Here row b holds its
positions 0..lengths[b]-1 in slots 0..lengths[b]-1 of its own buffer row, a forward writes each row's W
new positions at its own length (``put_along_axis``), and a commit only sets the lengths: nothing is
moved, rejected slots are simply past a row's length, as after ``trim``. Keys and values are padded to a
multiple of ``bucket`` past the longest row, with a boolean mask ``[B, 1, N, span]`` that hides every
slot past a row's query position; it is described (``hooks.attention.MaskSpec``: per-row key length and
offset), so that the attention kernel applies it from its bounds.

Lengths are host ints (every commit count is one); the device copy that rope, the writes and the mask
read is made once per distinct tuple and shared by every layer (``lengths_array``). ``offset`` is that
array: mlx-lm's models pass ``cache.offset`` to rope, which takes one offset per row.

Exactness: a row's real keys, values and positions are the ones a one-row ``KVCache`` holds, and every
other slot gets exactly zero weight after the softmax (the CPU tests compare tokens with rows decoded
alone, zero, partial and full acceptance).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ...hooks.api import Lengths, MaskSpec, check_range, describe

DEFAULT_BUCKET = 256
# per distinct lengths tuple (keyed by value): its [B] device array, and the write slots made from it by width
_ARRAYS: "OrderedDict[Tuple[int, ...], Tuple[mx.array, Dict[int, mx.array]]]" = OrderedDict()


def _entry(lengths: Sequence[int]) -> Tuple[mx.array, Dict[int, mx.array]]:
    key = tuple(int(n) for n in lengths)
    got = _ARRAYS.get(key)
    if got is None:
        got = (mx.array(key, dtype=mx.int32), {})
        _ARRAYS[key] = got
        while len(_ARRAYS) > 64:
            _ARRAYS.popitem(last=False)
    else:
        _ARRAYS.move_to_end(key)
    return got


def lengths_array(lengths: Sequence[int]) -> mx.array:
    """[B] int32 on the device for these host lengths, one array per distinct tuple (the last few kept)."""
    return _entry(lengths)[0]


def write_index(lengths: Sequence[int], width: int) -> mx.array:
    """[B, 1, W, 1] slots ``lengths[b] + 0..W-1``: where row b's W new positions go (one per forward: every
    layer's cache is at the same lengths, so they share it)."""
    offset, writes = _entry(lengths)
    got = writes.get(width)
    if got is None:
        got = writes[width] = (offset[:, None] + mx.arange(width, dtype=mx.int32)[None])[:, None, :, None]
    return got


def ragged_mask(offset: mx.array, queries: int, span: int, keys: int, cache: Any) -> mx.array:
    """[B, 1, N, span] bool: query i of row b sees slots j <= offset[b] + i (described to ``cache``)."""
    rows = offset[:, None] + mx.arange(queries, dtype=mx.int32)[None]  # [B, N]
    mask = (mx.arange(span, dtype=mx.int32)[None, None] <= rows[:, :, None])[:, None]  # [B, 1, N, span]
    return describe(mask, MaskSpec(queries, span, 0, offset + queries, offset, keys), cache)


class RaggedHandler:
    """Cache transactions over a ``RaggedBatchKVCache``: a commit sets each row's length, an abort restores them.
    Slots past a row's length are never read, so nothing else changes (the buffers keep what was written)."""

    ragged = True

    def begin(self, cache: "RaggedBatchKVCache") -> Tuple[int, ...]:
        return cache.lengths

    def written(self, cache: "RaggedBatchKVCache", start: Tuple[int, ...]) -> Optional[int]:
        return max((a - b for a, b in zip(cache.lengths, start)), default=0)

    def commit(self, cache: "RaggedBatchKVCache", start: Tuple[int, ...], n: Lengths) -> None:
        rows = [int(n)] * len(start) if isinstance(n, int) else [int(v) for v in n]
        if len(rows) != len(start):
            raise ValueError(f"per-row commit lengths {rows} do not fit a {type(cache).__name__} of {len(start)} rows")
        check_range(cache, rows, self.written(cache, start) or 0)
        cache.set_lengths([s + k for s, k in zip(start, rows)])

    def abort(self, cache: "RaggedBatchKVCache", start: Tuple[int, ...]) -> None:
        cache.set_lengths(start)


class RaggedBatchKVCache:
    """Rows of a batch, row b at its own length ``lengths[b]``; keys/values ``[B, H, S, D]`` (S a multiple of ``bucket``)."""

    transaction_handler = RaggedHandler()

    def __init__(self, lengths: Sequence[int], bucket: int = DEFAULT_BUCKET):
        if bucket < 1:
            raise ValueError(f"RaggedBatchKVCache bucket: got {bucket}; expected a positive integer")
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.bucket = bucket
        self.lengths: Tuple[int, ...] = tuple(int(n) for n in lengths)
        self.offset: mx.array = lengths_array(self.lengths)  # [B]: each row's next position (rope reads it)

    def set_lengths(self, lengths: Sequence[int]) -> None:
        self.lengths = tuple(int(n) for n in lengths)
        self.offset = lengths_array(self.lengths)

    def span(self, end: int) -> int:
        """Padded key length for a longest row of ``end`` positions."""
        return max(1, -(-end // self.bucket)) * self.bucket

    def _fit(self, end: int, like_k: mx.array, like_v: mx.array) -> None:
        """Buffers of at least ``span(end)`` slots (grown with zeros; new buffers shaped like the writes)."""
        want = self.span(end)
        if self.keys is None:
            B, H, _, Dk = like_k.shape
            self.keys = mx.zeros((B, H, want, Dk), like_k.dtype)
            self.values = mx.zeros((B, H, want, like_v.shape[3]), like_v.dtype)
        elif self.keys.shape[2] < want:
            pad = [(0, 0), (0, 0), (0, want - self.keys.shape[2]), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        W = keys.shape[2]  # keys: [B, H, W, D]
        end = max(self.lengths) + W
        self._fit(end, keys, values)
        idx = write_index(self.lengths, W)  # [B, 1, W, 1]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, keys.shape), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, values.shape), values, axis=2)
        self.set_lengths([n + W for n in self.lengths])
        return self.keys_and_values(end)

    def keys_and_values(self, end: Optional[int] = None) -> Tuple[mx.array, mx.array]:
        span = self.span(max(self.lengths) if end is None else end)
        if self.keys.shape[2] == span:
            return self.keys, self.values
        return self.keys[..., :span, :], self.values[..., :span, :]  # [B, H, span, D]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs: Any) -> mx.array:
        if window_size is not None:
            raise ValueError("RaggedBatchKVCache does not support sliding-window attention; use the model's own cache")
        # Called before update_and_fetch: row b's queries are positions lengths[b]..lengths[b]+N-1.
        end = max(self.lengths) + N
        return ragged_mask(self.offset, N, self.span(end), end, self)

    # rows joining and leaving ----------------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "RaggedBatchKVCache":
        """One batched cache out of one-row caches (``KVCache`` and subclasses: their first ``offset`` slots)."""
        lengths = [int(c.offset) for c in caches]
        bucket = next((c.bucket for c in caches if hasattr(c, "bucket")), DEFAULT_BUCKET)
        out = cls(lengths, bucket)
        full = [c for c in caches if c.keys is not None]
        if not full:
            return out
        k0, v0 = full[0].keys, full[0].values
        span = out.span(max(lengths))
        keys = mx.zeros((len(caches), k0.shape[1], span, k0.shape[3]), k0.dtype)
        values = mx.zeros((len(caches), v0.shape[1], span, v0.shape[3]), v0.dtype)
        for b, (c, n) in enumerate(zip(caches, lengths)):
            if c.keys is not None and n:
                keys[b : b + 1, :, :n] = c.keys[..., :n, :]
                values[b : b + 1, :, :n] = c.values[..., :n, :]
        out.keys, out.values = keys, values
        return out

    def extend(self, other: "RaggedBatchKVCache") -> None:
        """Append the rows of ``other`` after this cache's rows, in place."""
        if other.keys is not None and self.keys is None:
            B = len(self.lengths)
            self.keys = mx.zeros((B, *other.keys.shape[1:]), other.keys.dtype)
            self.values = mx.zeros((B, *other.values.shape[1:]), other.values.dtype)
        if self.keys is not None:
            theirs_k, theirs_v = other.keys, other.values
            if theirs_k is None:
                theirs_k = mx.zeros((len(other.lengths), *self.keys.shape[1:]), self.keys.dtype)
                theirs_v = mx.zeros((len(other.lengths), *self.values.shape[1:]), self.values.dtype)
            S = max(self.keys.shape[2], theirs_k.shape[2])

            def to(a: mx.array) -> mx.array:
                return a if a.shape[2] == S else mx.pad(a, [(0, 0), (0, 0), (0, S - a.shape[2]), (0, 0)])

            self.keys = mx.concatenate([to(self.keys), to(theirs_k)])
            self.values = mx.concatenate([to(self.values), to(theirs_v)])
        self.set_lengths(self.lengths + other.lengths)

    def filter(self, batch_indices: Union[mx.array, Sequence[int]]) -> None:
        """Keep only these rows, in this order, in place."""
        keep = batch_indices.tolist() if isinstance(batch_indices, mx.array) else [int(i) for i in batch_indices]
        if self.keys is not None:
            index = mx.array(keep)
            self.keys, self.values = self.keys[index], self.values[index]
        self.set_lengths([self.lengths[i] for i in keep])

    def extract(self, idx: int) -> KVCache:
        """Row ``idx`` as a one-row cache of the class these rows merged from (a padded ``KVCache``)."""
        from .backend import PaddedKVCache  # the one-row class of the shape-stable policy

        cache = PaddedKVCache(self.bucket)
        n = self.lengths[idx]
        if self.keys is not None and n:
            cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, :n])
            cache.values = mx.contiguous(self.values[idx : idx + 1, :, :n])
            cache.offset = n
        return cache

    # the rest of mlx-lm's cache interface ---------------------------------------------------
    def trim(self, n: int) -> int:
        n = min(n, min(self.lengths, default=0))
        self.set_lengths([m - n for m in self.lengths])
        return n

    def size(self) -> mx.array:
        """Each row's next slot, [B] (a row's slots are its positions)."""
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return self.keys is None

    @property
    def state(self) -> Tuple[Optional[mx.array], Optional[mx.array], Tuple[int, ...]]:
        return self.keys, self.values, self.lengths

    @state.setter
    def state(self, v: Tuple[Optional[mx.array], Optional[mx.array], Sequence[int]]) -> None:
        self.keys, self.values = v[0], v[1]
        self.set_lengths(v[2])

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def row_lengths(caches: Sequence[Any]) -> Optional[List[int]]:
    """The rows' lengths where every cache is a ``RaggedBatchKVCache`` at the same lengths, else None."""
    if not caches or any(type(c) is not RaggedBatchKVCache for c in caches):
        return None
    first = caches[0].lengths
    return list(first) if all(c.lengths == first for c in caches) else None
