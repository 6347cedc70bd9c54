"""Per row, the target features a drafter has fed to its own cache (``FeatureLog``), for the server's
prompt cache.

EAGLE-3 and the MTP heads (Qwen3.5 / Qwen3-Next, DeepSeek nextn) make each entry of their caches
out of position t's target features and token t + 1. A request that shares the first t + 1 tokens
of a cached one but not token t + 1 (a conversation that branches there, a prompt cut short) can
keep entries 0..t-1 only, and needs position t's features to make entry t with its own next token:
the target's restored caches do not give them back (the host captures only what it feeds). So
these drafters keep every fed position's features next to their caches, for the rows the prompt
cache will save (``DecodeState.saved``), and ``export_row`` hands them over with the caches.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set

import mlx.core as mx

from ..hooks.api import arrays, cache_bytes, copy_caches, extract_row, trim_caches
from .base import DraftState

STEP = 256  # positions a row's buffer grows by (as mlx-lm's KVCache grows)


class FeatureLog:
    """[1, capacity, H] per row (by ``id``), written in place; ``sizes`` positions hold features."""

    def __init__(self) -> None:
        self.buffers: Dict[int, mx.array] = {}
        self.sizes: Dict[int, int] = {}

    def keep(self, present: Set[int]) -> None:
        """Rows not in ``present`` (ids) left the batch."""
        self.buffers = {k: v for k, v in self.buffers.items() if k in present}
        self.sizes = {k: v for k, v in self.sizes.items() if k in present}

    def append(self, row: Any, features: mx.array) -> None:
        """The row's next n positions' features, [1, n, H]; kept only for rows the prompt cache saves."""
        if not row.saved:
            return
        key, n = id(row), features.shape[1]
        size, buf = self.sizes.get(key, 0), self.buffers.get(key)
        if buf is None or size + n > buf.shape[1]:
            grown = mx.zeros((1, -(-(size + n) // STEP) * STEP, features.shape[2]), features.dtype)
            if size:
                grown[:, :size] = buf[:, :size]
            buf = grown
        buf[:, size : size + n] = features
        self.buffers[key], self.sizes[key] = buf, size + n

    def read(self, row: Any) -> Optional[mx.array]:
        """[1, n, H]: the features of the row's first n positions (a view of the buffer), or None."""
        key = id(row)
        return self.buffers[key][:, : self.sizes[key]] if self.sizes.get(key) else None

    def arrays(self) -> List[mx.array]:
        """The buffers, to evaluate with the round (else each one's writes chain up unevaluated)."""
        return list(self.buffers.values())


def joined(parts: List[Optional[mx.array]], positions: int) -> Optional[mx.array]:
    """[1, p, H]: the first ``positions`` positions of the parts laid end to end, as a new array that
    shares no buffer (a prompt-cache entry holds exactly what it counts), or None when empty."""
    parts = [p for p in parts if p is not None and p.shape[1]]
    if not parts or positions <= 0:
        return None
    whole = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    return mx.array(whole[:, :positions])


# A batch keeping a FeatureLog (EAGLE-3's, the MTP heads'): its ``rows``, ``cache`` (batched, or one
# row's own), ``context`` (entries per row), ``log``, ``restored`` (id(row) -> (caches, entries,
# features)) and ``drafter.make_cache()``.

def export_row(batch: Any, row: Any, positions: int, fresh: Optional[mx.array]) -> Optional[DraftState]:
    """The row's state for the prompt cache: (caches holding c entries, c, [1, p, H] features of
    positions 0..p-1), c < p, since entry p-1 pairs with token p, which the p tokens do not include.
    ``fresh``: [1, n, H] features the host handed over that the batch has not fed yet, or None."""
    if not row.saved:
        return None  # no feature log kept (no prompt cache)
    b = next((i for i, r in enumerate(batch.rows) if r is row), None)
    if b is not None:
        caches, c = (extract_row(batch.cache, b) if len(batch.rows) > 1 else batch.cache), batch.context[b]
        known = batch.log.read(row)
        assert batch.log.sizes.get(id(row), 0) == c, "the feature log keeps step with the drafter's entries"
    elif id(row) in batch.restored:
        caches, c, known = batch.restored[id(row)]
    elif row.cached == 0:
        caches, c, known = batch.drafter.make_cache(), 0, None
    else:
        return None  # the captures it has start after positions it holds no features for
    feats = joined([known, fresh], positions)
    if feats is None:
        return None
    p = feats.shape[1]
    caches = copy_caches(caches)
    trim_caches(caches, c - min(c, p - 1))
    mx.eval(arrays(caches), feats)
    return DraftState(p, (caches, min(c, p - 1), feats), cache_bytes(caches) + feats.nbytes)


def restore_row(batch: Any, row: Any, saved: DraftState, n: int) -> bool:
    """Reuse ``saved`` for the row's first n tokens: entry n-1 pairs with this row's token n, so it is
    made again from its features at the next prepare."""
    caches, c, feats = saved.value
    if saved.positions < n:
        raise RuntimeError(f"{type(batch).__name__}: the saved state covers {saved.positions} positions; "
                           f"the row reuses {n}")
    keep = min(c, n - 1)
    caches = copy_caches(caches)
    trim_caches(caches, c - keep)
    batch.restored[id(row)] = (caches, keep, feats[:, :n])
    return True
