"""hooks.kv_view: the committed K/V of mlx-lm's attention caches, with each slot's position.

Each key written for position t holds the number t, so a view is right when every valid slot's key
equals its position. The caches go through prompt chunks, one-token steps, wrapped windows,
verify-sized updates, trims, ragged batch commits (mlx-lm's right-padding path) and merges.
"""

from __future__ import annotations

import random
from typing import Any, List, Sequence

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlx_speculative.hooks.kv_view import committed_kv

pytestmark = pytest.mark.unit


def _kv(start: Sequence[int], n: int) -> Any:
    """[B, 1, n, 2] keys (and values = -keys) holding positions start[b] .. start[b] + n - 1."""
    pos = np.asarray(start)[:, None] + np.arange(n)[None]  # [B, n]
    k = mx.array(np.repeat(pos[:, None, :, None], 2, axis=3).astype(np.float32))
    return k, -k


def check(cache: Any, counts: List[int], window: int = 0) -> None:
    """Every valid slot holds its own position; row b holds positions [counts[b] - held, counts[b])
    with at least min(window - 1, counts[b]) of them (all of them without a window)."""
    view = committed_kv(cache)
    keys, pos = np.array(view.keys[:, 0, :, 0]), np.array(view.positions)  # [B, S]
    assert np.array_equal(np.array(view.values[:, 0, :, 0]), -keys)
    for b, count in enumerate(counts):
        valid = pos[b] >= 0
        assert np.array_equal(keys[b][valid], pos[b][valid]), (b, keys[b], pos[b])
        got = sorted(pos[b][valid].tolist())
        assert got == list(range(count - len(got), count)), (b, got, count)
        need = count if not window else min(window - 1, count)
        assert len(got) >= need, (b, got, need)


@pytest.mark.parametrize("window", [0, 6])
def test_single_row_caches(window: int) -> None:
    cache = RotatingKVCache(max_size=window) if window else KVCache()
    assert committed_kv(cache) is None
    count = 0
    rng = random.Random(0)
    for step in range(40):
        n = rng.choice([1, 1, 1, 3, 5]) if step else 9  # a prompt chunk, steps and verify-sized updates
        cache.update_and_fetch(*_kv([count], n))
        count += n
        check(cache, [count], window)
        if n > 1 and (not window or cache.is_trimmable()) and rng.random() < 0.5:
            cache.trim(n - 1)  # a rejected block, where mlx-lm can trim
            count -= n - 1
            check(cache, [count], window)


@pytest.mark.parametrize("window", [0, 6])
def test_batched_caches(window: int) -> None:
    rows = []
    counts = [3, 9, 5]
    for c in counts:
        cache = RotatingKVCache(max_size=window) if window else KVCache()
        cache.update_and_fetch(*_kv([0], c))
        rows.append(cache)
    batch = (BatchRotatingKVCache if window else BatchKVCache).merge(rows)
    check(batch, counts, window)
    rng = random.Random(1)
    for _ in range(30):
        n = rng.choice([1, 1, 4])
        start = batch.state
        batch.update_and_fetch(*_kv(counts, n))
        if n > 1 and window:  # a ragged commit as hooks/rotating.py makes it: restore, then one right-padded update
            keep = [rng.randint(2, n) for _ in counts]
            batch.state = start
            batch.prepare(lengths=keep, right_padding=[max(keep) - k for k in keep])
            k, v = _kv(counts, max(keep))
            batch.update_and_fetch(k, v)
            batch.finalize()
            counts = [c + k for c, k in zip(counts, keep)]
            check(batch, counts, window)
            continue
        counts = [c + n for c in counts]
        check(batch, counts, window)
        if n > 1 and not window:
            keep = [rng.randint(1, n) for _ in counts]  # ragged commit: each row keeps its own count
            batch.trim(n - max(keep))
            batch.prepare(right_padding=[max(keep) - k for k in keep])
            batch.finalize()
            counts = [c - n + k for c, k in zip(counts, keep)]
            check(batch, counts, window)
    assert np.array_equal(np.array(committed_kv(batch).rows(mx.array([2, 0])).positions),
                          np.array(committed_kv(batch).positions)[[2, 0]])


def test_unknown_cache_is_refused() -> None:
    with pytest.raises(TypeError, match="supported cache types: KVCache"):
        committed_kv(QuantizedKVCache())
