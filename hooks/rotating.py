"""Cache transactions on sliding-window caches: RotatingKVCache and BatchRotatingKVCache.

Once the window has wrapped, a multi-token forward overwrote (or trimmed away) entries the kept
state still needs, and mlx-lm lays out multi-token updates (``_update_concat``) differently from
one-token ones (``_update_in_place``). So the handler keeps the start state (``state``, by
reference) and records the K/V every update brings; ``commit(n)`` restores the start and replays
the kept updates through the cache's own ``update_and_fetch``: whole updates as they were fed, the
kept part of a partly kept update as one update (one token: the in-place path, as one-token
decoding; more: the multi-token path, as a prompt chunk; both hold the same window). No model
forward is needed. While nothing has been dropped (start + written < max_size) a trim is exact.

With ``keep > 0`` (``max_kv_size`` on models without ``make_cache``) mlx-lm's multi-token mask
ignores the kept tokens once the window is exceeded, so the verify itself differs from one-token
decoding: such a forward is refused (``UnsupportedCache``) before it writes.

The recording is an instance attribute ``update_and_fetch`` on the cache object for the duration
of the transaction (models call ``cache.update_and_fetch``); commit and abort remove it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from .cache_ops import Lengths, UnsupportedCache, check_range, handle, uniform


class Recording:
    """Begin state of a rotating cache and the K/V of every update since."""

    def __init__(self, start: tuple):
        self.start = start
        self.updates: List[Tuple[mx.array, mx.array]] = []  # ([B, H, S, D], [B, H, S, Dv])

    @property
    def written(self) -> int:
        return sum(k.shape[2] for k, _ in self.updates)


class RotatingHandler:
    """RotatingKVCache: restore the start state and replay the kept updates (see the module doc)."""

    ragged = False
    arrays: Tuple[str, ...] = ("keys", "values")
    size_index = 2  # where state[] holds the positions ever fed (offset)

    def begin(self, cache: Any) -> Recording:
        rec = Recording(cache.state)
        for f in self.arrays:
            setattr(cache, f, handle(getattr(cache, f)))
        update = type(cache).update_and_fetch

        def recording_update(keys: mx.array, values: mx.array) -> Any:
            self._check(cache, keys.shape[2])
            rec.updates.append((keys, values))
            return update(cache, keys, values)

        cache.update_and_fetch = recording_update
        return rec

    def _stop(self, cache: Any) -> None:
        cache.__dict__.pop("update_and_fetch", None)

    def _check(self, cache: Any, width: int) -> None:
        if getattr(cache, "keep", 0) and width > 1 and cache.offset + width > cache.max_size:
            raise UnsupportedCache(
                f"RotatingKVCache(max_size={cache.max_size}, keep={cache.keep}) at offset {cache.offset}: a "
                f"{width}-token forward past the window differs from one-token decoding in mlx-lm (its mask "
                "ignores keep), so speculative rounds cannot be exact; use a cache without keep (no max_kv_size)"
            )

    def written(self, cache: Any, rec: Recording) -> Optional[int]:
        return rec.written

    def _trim_is_exact(self, cache: Any, rec: Recording) -> bool:
        # Nothing was dropped or overwritten: mlx-lm's own trimmability rule on the state after the forward.
        return rec.start[self.size_index] + rec.written < cache.max_size

    def commit(self, cache: Any, rec: Recording, n: Lengths) -> None:
        self._stop(cache)
        m = uniform(n)
        if m is None:
            raise ValueError(f"a {type(cache).__name__} holds one row; got per-row lengths {list(n)}")
        check_range(cache, m, rec.written)
        if m == rec.written:
            return
        if self._trim_is_exact(cache, rec):
            cache.trim(rec.written - m)
            return
        cache.state = rec.start
        replay_updates(cache, rec.updates, m)

    def abort(self, cache: Any, rec: Recording) -> None:
        self._stop(cache)
        cache.state = rec.start


def replay_updates(cache: Any, updates: Sequence[Tuple[mx.array, mx.array]], n: int) -> None:
    """Feed the first n positions of ``updates`` again through the cache's own update path."""
    left = n
    for keys, values in updates:
        size = keys.shape[2]
        if left >= size:
            cache.update_and_fetch(keys, values)
            left -= size
            continue
        if left > 0:
            cache.update_and_fetch(keys[..., :left, :], values[..., :left, :])
        break


class BatchRotatingHandler(RotatingHandler):
    """BatchRotatingKVCache: as RotatingKVCache; unequal per-row lengths go through mlx-lm's
    right-padding path (``prepare(lengths=, right_padding=)`` + ``finalize``), which turns each
    row's rejected tail into left padding."""

    ragged = True
    arrays = ("keys", "values", "offset", "left_padding")
    size_index = 5  # state: keys, values, offset, left_padding, max_size, _offset, _idx, rotated

    def commit(self, cache: Any, rec: Recording, n: Lengths) -> None:
        if uniform(n) is not None:
            return super().commit(cache, rec, uniform(n))
        self._stop(cache)
        rows = [int(v) for v in n]
        written, keep = rec.written, max(rows)
        if len(rows) != cache.offset.shape[0]:
            raise ValueError(f"per-row commit lengths {rows} do not fit a BatchRotatingKVCache of "
                             f"{cache.offset.shape[0]} rows")
        check_range(cache, rows, written)
        # Updates kept whole by every row replay as fed; the rest as one right-padded chunk.
        left, whole = min(rows), []
        for keys, values in rec.updates:
            if keys.shape[2] > left:
                break
            whole.append((keys, values))
            left -= keys.shape[2]
        done = min(rows) - left
        cache.state = rec.start
        if keep - done < 2:
            raise UnsupportedCache(
                f"BatchRotatingKVCache: per-row lengths {rows} split a one-token update; commit equal lengths"
            )
        replay_updates(cache, whole, done)
        keys = mx.concatenate([k for k, _ in rec.updates], axis=2)[..., done:keep, :]  # [B, H, keep-done, D]
        values = mx.concatenate([v for _, v in rec.updates], axis=2)[..., done:keep, :]
        cache.prepare(lengths=[v - done for v in rows], right_padding=[keep - v for v in rows])
        cache.update_and_fetch(keys, values)
        cache.finalize()
