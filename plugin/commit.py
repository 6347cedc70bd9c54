"""Committing a round: cache transactions. The verify forward writes B positions; ``commit(n)`` keeps the first n.

Every cache must end exactly as if only the kept tokens had been fed, and ``abort()`` must give
back the exact start state. Each cache type has a handler; a type without one is refused by name,
never guessed at (lookup is by exact type: a subclass may store its state differently).

How each cache type is rolled back, and why:

- KVCache, QuantizedKVCache, ConcatenateKVCache, BatchKVCache: positions are a prefix of an
  array, so ``trim`` drops the tail. Exact and free.
- ChunkedKVCache: trim as well, but the model may drop the front (``maybe_trim_front``) inside the
  forward, so begin keeps a reference to the arrays for ``abort``.
- RotatingKVCache, BatchRotatingKVCache: once the window has wrapped, the verify forward overwrote
  (or trimmed away) entries that the kept state still needs, and mlx-lm lays out multi-token
  updates (``_update_concat``) differently from one-token ones (``_update_in_place``). The handler
  keeps the start state (the arrays by reference: cheap) and records the K/V every update brings;
  ``commit(n)`` restores the start and replays the kept updates through the cache's own
  ``update_and_fetch``: whole updates as they were fed, the kept part of a partly kept update as
  one update (one token: mlx-lm's in-place path, as one-token decoding; more: its multi-token
  path, as a prompt chunk; both hold the same window, and one call per layer is the fewest ops).
  No model forward is needed. While nothing has been dropped (start offset + written < max_size)
  a trim is exact and used. With ``keep > 0`` (``max_kv_size`` on models without ``make_cache``)
  mlx-lm's multi-token mask ignores the kept tokens once the window is exceeded, so the verify
  itself differs from one-token decoding: such a forward is refused (UnsupportedCache) before it
  writes, and the round falls back to plain decoding.
- ArraysCache (GatedDeltaNet conv + recurrent state, Mamba/SSM state): a snapshot by reference
  at begin (abort and commit(0) restore it), and an innovation tape (``recurrent_tape``) over the
  forward: the inputs of every call of mlx-lm's shared recurrence primitives
  (``gated_delta_update``, ``ssm_update``) and every conv input (``concatenate([cache[0], x])``),
  matched to the cache by the identity of the state arrays it holds. Which path a commit takes:
  * n == written (all kept): nothing to do, the forward's own state stays.
  * 0 < n < written and the tape explains every slot the forward changed (``Tape.usable``): the
    tape. The conv state is cut from the recorded conv input ([n : n + K-1]); the recurrent state
    is the recorded state after n positions when the primitive stepped position by position
    (gated_delta's ops path on CPU: bit-equal to one-token feeding), else the SAME primitive run
    again on the recorded inputs [:, :n] from the incoming state (compiled; SSM calls of all
    layers as one call). No model forward: the cost is the recurrence alone.
  * otherwise (a layer whose recurrence is not a wrapped primitive, ``lengths`` set, positions that
    do not add up): the fallback. Every cache of the transaction is restored and the kept tokens
    replayed through the model's ordinary forward (``replay`` callback supplied by the round):
    exact, one forward over the kept tokens (lazily evaluated: the replay's logits are never
    computed); the other caches are restored first so that nothing is updated twice.
  Measured (bench/commit_cost.py, CPU, B = 8, tiny models): the replay cost ~37-39% of round time,
  the tape 3% (qwen3_5) and ~9-12% (falcon_h1, mamba2: one SSD evaluation of all layers, whose
  launches dominate a 2-layer model on this CPU). Positions written are counted from the layers'
  ``cache.advance`` calls (or other caches, or the tape); a model that reports none gets a replay
  even for a full commit unless ``commit(n, written=...)`` says how many positions were fed.
- CacheList: each child by its own handler.

Batched caches take per-row commit lengths. BatchKVCache commits them exactly (ragged): the rows
that keep fewer positions are shifted right and the rejected tail becomes left padding, mlx-lm's
own representation of shorter rows. BatchRotatingKVCache does the same through mlx-lm's
right-padding path (``prepare(lengths=...)`` + ``finalize``). Recurrent caches (ArraysCache: tape
or replay) need uniform acceptance: a transaction holding one reports ``ragged == False`` and
refuses unequal lengths; a batched round loop must then commit the minimum for every row
(lossless: a row with a longer accepted prefix emits the target's own token at the first position
it loses).

Handlers are plain objects with ``begin(cache) -> token``, ``commit(cache, token, n)`` and
``abort(cache, token)``; optional: ``written(cache, token) -> Optional[int]``,
``needs_replay(cache, token, n, written) -> bool`` and ``ragged`` (per-row ``n``). Other modules
may register handlers in ``HANDLERS`` (keyed by cache type).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    dynamic_roll,
)

from .recurrent_tape import Tape, apply_all, open_tape

Lengths = Union[int, Sequence[int]]


class UnsupportedCache(TypeError):
    pass


def _handle(x: Optional[mx.array]) -> Optional[mx.array]:
    """A new array object sharing ``x``'s data: in-place writes (``a[i] = v``, ``a -= 1``) to it
    copy instead of reaching ``x``, so a reference kept at begin stays the start state."""
    return None if x is None else mx.stop_gradient(x)


def _uniform(n: Lengths) -> Optional[int]:
    if isinstance(n, int):
        return n
    values = [int(v) for v in n]
    return values[0] if values and all(v == values[0] for v in values) else None


class _TrimHandler:
    """Caches whose positions are a prefix of an array: drop the tail with ``trim``."""

    ragged = False

    def begin(self, cache: Any) -> int:
        return cache.offset

    def written(self, cache: Any, start: int) -> Optional[int]:
        return cache.offset - start

    def commit(self, cache: Any, start: int, n: Lengths) -> None:
        n = _uniform(n)
        written = cache.offset - start
        if n is None or not 0 <= n <= written:
            raise ValueError(f"cannot keep {n} of the {written} positions written to a {type(cache).__name__}")
        cache.trim(written - n)

    def abort(self, cache: Any, start: int) -> None:
        cache.trim(cache.offset - start)


class _ChunkedHandler(_TrimHandler):
    """ChunkedKVCache: trim, but the model may drop the front inside the forward; abort restores it."""

    def begin(self, cache: Any) -> Tuple[int, tuple]:
        start = (cache.keys, cache.values, cache.offset, cache.start_position)
        cache.keys, cache.values = _handle(cache.keys), _handle(cache.values)
        return cache.offset, start

    def written(self, cache: Any, token: Tuple[int, tuple]) -> Optional[int]:
        return cache.offset - token[0]

    def commit(self, cache: Any, token: Tuple[int, tuple], n: Lengths) -> None:
        super().commit(cache, token[0], n)

    def abort(self, cache: Any, token: Tuple[int, tuple]) -> None:
        cache.keys, cache.values, cache.offset, cache.start_position = token[1]


class _BatchTrimHandler:
    """BatchKVCache: per-row commit lengths. All rows share one write index, so the cache keeps
    max(n) positions and each shorter row is shifted right by what it rejects; the rejected tail
    wraps to the front and becomes left padding (masked, and excluded from the row's offset)."""

    ragged = True

    def begin(self, cache: Any) -> int:
        return cache._idx

    def written(self, cache: Any, start: int) -> Optional[int]:
        return cache._idx - start

    def commit(self, cache: Any, start: int, n: Lengths) -> None:
        written = cache._idx - start
        rows = [int(n)] * cache.offset.shape[0] if isinstance(n, int) else [int(v) for v in n]
        if len(rows) != cache.offset.shape[0] or not all(0 <= v <= written for v in rows):
            raise ValueError(
                f"per-row commit lengths {rows} do not fit a BatchKVCache of {cache.offset.shape[0]} rows "
                f"with {written} positions written"
            )
        keep = max(rows)
        cache.trim(written - keep)
        shift = [keep - v for v in rows]
        if any(shift):
            s = mx.array(shift)  # [B]
            idx = cache._idx
            cache.keys = dynamic_roll(cache.keys[..., :idx, :], s[:, None], axis=2)
            cache.values = dynamic_roll(cache.values[..., :idx, :], s[:, None], axis=2)
            cache.left_padding = cache.left_padding + s
            cache.offset = cache.offset - s

    def abort(self, cache: Any, start: int) -> None:
        cache.trim(cache._idx - start)


class _Recording:
    """Begin state of a rotating cache and the K/V of every update since."""

    def __init__(self, start: tuple):
        self.start = start
        self.updates: List[Tuple[mx.array, mx.array]] = []  # ([B, H, S, D], [B, H, S, Dv])

    @property
    def written(self) -> int:
        return sum(k.shape[2] for k, _ in self.updates)


class _RotatingHandler:
    """RotatingKVCache: restore the start state and replay the kept updates (see the module doc)."""

    ragged = False
    fields: Tuple[str, ...] = ("keys", "values", "offset", "_idx")
    arrays: Tuple[str, ...] = ("keys", "values")

    def begin(self, cache: Any) -> _Recording:
        rec = _Recording(tuple(getattr(cache, f) for f in self.fields))
        for f in self.arrays:
            setattr(cache, f, _handle(getattr(cache, f)))
        update = type(cache).update_and_fetch

        def recording_update(keys: mx.array, values: mx.array) -> Any:
            self._check(cache, keys.shape[2])
            rec.updates.append((keys, values))
            return update(cache, keys, values)

        # An instance attribute: models call ``cache.update_and_fetch``; removed at commit/abort.
        cache.update_and_fetch = recording_update
        return rec

    def _stop(self, cache: Any) -> None:
        cache.__dict__.pop("update_and_fetch", None)

    def _check(self, cache: Any, width: int) -> None:
        # mlx-lm's multi-token path masks a plain sliding window and ignores the ``keep`` first
        # tokens (max_kv_size gives keep=4), so once the window is exceeded a verify forward differs
        # from one-token decoding: nothing a commit can repair. Refuse it (the round falls back).
        if getattr(cache, "keep", 0) and width > 1 and cache.offset + width > cache.max_size:
            raise UnsupportedCache(
                f"RotatingKVCache(max_size={cache.max_size}, keep={cache.keep}) at offset {cache.offset}: a "
                f"{width}-token forward past the window differs from one-token decoding in mlx-lm (its mask "
                "ignores keep), so speculative rounds cannot be exact; use a cache without keep (no max_kv_size)"
            )

    def _restore(self, cache: Any, rec: _Recording) -> None:
        for f, v in zip(self.fields, rec.start):
            setattr(cache, f, v)

    def written(self, cache: Any, rec: _Recording) -> Optional[int]:
        return rec.written

    def _trim_is_exact(self, cache: Any, rec: _Recording) -> bool:
        # Nothing was dropped or overwritten: mlx-lm's own trimmability rule on the state after the forward.
        return rec.start[2] + rec.written < cache.max_size

    def commit(self, cache: Any, rec: _Recording, n: Lengths) -> None:
        self._stop(cache)
        n = _uniform(n)
        written = rec.written
        if n is None or not 0 <= n <= written:
            raise ValueError(f"cannot keep {n} of the {written} positions written to a {type(cache).__name__}")
        if n == written:
            return
        if self._trim_is_exact(cache, rec):
            cache.trim(written - n)
            return
        self._restore(cache, rec)
        self._replay(cache, rec.updates, n)

    def _replay(self, cache: Any, updates: List[Tuple[mx.array, mx.array]], n: int) -> None:
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

    def abort(self, cache: Any, rec: _Recording) -> None:
        self._stop(cache)
        self._restore(cache, rec)


class _BatchRotatingHandler(_RotatingHandler):
    """BatchRotatingKVCache: as RotatingKVCache; unequal per-row lengths go through mlx-lm's
    right-padding path, which turns each row's rejected tail into left padding."""

    ragged = True
    fields = ("keys", "values", "offset", "left_padding", "_offset", "_idx", "rotated", "_lengths")
    arrays = ("keys", "values", "offset", "left_padding")

    def _trim_is_exact(self, cache: Any, rec: _Recording) -> bool:
        return rec.start[4] + rec.written < cache.max_size

    def commit(self, cache: Any, rec: _Recording, n: Lengths) -> None:
        if _uniform(n) is not None:
            return super().commit(cache, rec, _uniform(n))
        self._stop(cache)
        rows = [int(v) for v in n]
        written = rec.written
        keep = max(rows)
        if len(rows) != cache.offset.shape[0] or not all(0 <= v <= written for v in rows):
            raise ValueError(
                f"per-row commit lengths {rows} do not fit a BatchRotatingKVCache of {cache.offset.shape[0]} "
                f"rows with {written} positions written"
            )
        # Updates kept whole by every row replay as fed; the rest as one right-padded chunk.
        left, whole = min(rows), []
        for keys, values in rec.updates:
            if keys.shape[2] > left:
                break
            whole.append((keys, values))
            left -= keys.shape[2]
        done = min(rows) - left
        if keep - done < 2:
            self._restore(cache, rec)
            raise UnsupportedCache(
                f"BatchRotatingKVCache: per-row lengths {rows} split a one-token update; commit equal lengths"
            )
        self._restore(cache, rec)
        self._replay(cache, whole, done)
        keys = mx.concatenate([k for k, _ in rec.updates], axis=2)[..., done:keep, :]  # [B, H, keep-done, D]
        values = mx.concatenate([v for _, v in rec.updates], axis=2)[..., done:keep, :]
        cache.prepare(lengths=[v - done for v in rows], right_padding=[keep - v for v in rows])
        cache.update_and_fetch(keys, values)
        cache.finalize()


class _ArraysState:
    """Begin state of an ArraysCache, the positions the model reported through ``advance``, and
    the innovation tape of the forward (``recurrent_tape``)."""

    def __init__(self, start: tuple, tape: Tape):
        self.start = start
        self.tape = tape
        self.fed = 0
        self.taped = False  # the last commit kept a partial block through the tape


class _ArraysHandler:
    """ArraysCache: snapshot by reference; a partial commit through the innovation tape, else a
    model replay (see the module doc).

    Most mlx-lm recurrent layers call ``cache.advance(S)`` once per forward; counting those calls
    tells a full commit (free) from a partial one even when no attention cache counts positions,
    and marks where the tape re-keys the cache's slots for the next forward.
    """

    ragged = False

    def begin(self, cache: Any) -> _ArraysState:
        start = (list(cache.cache), cache.left_padding, cache.lengths)
        cache.cache = [_handle(c) for c in cache.cache]
        cache.left_padding, cache.lengths = _handle(cache.left_padding), _handle(cache.lengths)
        token = _ArraysState(start, open_tape(cache))
        advance = type(cache).advance

        def counting_advance(n: int) -> Any:
            token.fed += int(n)
            out = advance(cache, n)
            token.tape.rekey()
            return out

        cache.advance = counting_advance  # an instance attribute, removed at commit/abort
        return token

    def _stop(self, cache: Any, token: _ArraysState) -> None:
        cache.__dict__.pop("advance", None)
        token.tape.close()

    def written(self, cache: Any, token: _ArraysState) -> Optional[int]:
        # None: the model reports no positions (and the tape recorded none).
        return token.fed or (token.tape.positions() if token.tape.calls else None)

    def needs_replay(self, cache: Any, token: _ArraysState, n: Lengths, written: Optional[int]) -> bool:
        m = _uniform(n)
        if m is None:
            raise UnsupportedCache(
                f"{type(cache).__name__} keeps a partial block by recomputing its recurrence over the kept "
                f"positions, which needs the same commit length for every row (got {list(n)}); commit the minimum"
            )
        if m == 0 or m == (written if written is not None else self.written(cache, token)):
            return False
        return token.tape.usable(m, token.fed) is not None

    def tape_request(self, cache: Any, token: _ArraysState, n: Lengths) -> Optional[Tuple[Tape, int]]:
        """(tape, n) when committing n positions takes the tape (a usable partial commit)."""
        m = _uniform(n)
        if m and m != self.written(cache, token) and token.tape.usable(m, token.fed) is None:
            return token.tape, m
        return None

    def commit(self, cache: Any, token: _ArraysState, n: Lengths) -> None:
        m = _uniform(n)
        if m == 0:
            self.abort(cache, token)
            return
        # A partial commit reaches here only when the tape is usable (else ``needs_replay`` made the
        # transaction restore and replay); the transaction usually applied it already, for all
        # recurrent caches at once (``apply_all``). A full commit keeps everything written.
        if not token.taped:
            request = self.tape_request(cache, token, n)
            if request is not None:
                apply_all([request])
                token.taped = True
        self._stop(cache, token)
        if token.taped:
            # What ``advance`` did, for the kept positions only (the tape requires lengths None).
            start_lp = token.start[1]
            cache.left_padding = None if start_lp is None else start_lp - m

    def abort(self, cache: Any, token: _ArraysState) -> None:
        self._stop(cache, token)
        cache.cache, cache.left_padding, cache.lengths = list(token.start[0]), token.start[1], token.start[2]


class _CacheListHandler:
    """CacheList (e.g. Falcon-H1's Mamba + attention per layer): each child by its own handler."""

    def begin(self, cache: Any) -> List[Tuple[Any, Any]]:
        hs = [handler_for(c) for c in cache.caches]
        return [(h, h.begin(c)) for h, c in zip(hs, cache.caches)]

    def children_ragged(self, cache: Any) -> bool:
        return all(_is_ragged(handler_for(c), c) for c in cache.caches)

    def written(self, cache: Any, token: List[Tuple[Any, Any]]) -> Optional[int]:
        return _max_written(zip((h for h, _ in token), cache.caches, (t for _, t in token)))

    def needs_replay(self, cache: Any, token: List[Tuple[Any, Any]], n: Lengths, written: Optional[int]) -> bool:
        return any(_needs_replay(h, c, t, n, written) for (h, t), c in zip(token, cache.caches))

    def commit(self, cache: Any, token: List[Tuple[Any, Any]], n: Lengths) -> None:
        for (h, t), c in zip(token, cache.caches):
            h.commit(c, t, n)

    def abort(self, cache: Any, token: List[Tuple[Any, Any]]) -> None:
        for (h, t), c in zip(token, cache.caches):
            h.abort(c, t)


HANDLERS: Dict[type, Any] = {
    KVCache: _TrimHandler(),
    QuantizedKVCache: _TrimHandler(),
    ConcatenateKVCache: _TrimHandler(),
    ChunkedKVCache: _ChunkedHandler(),
    BatchKVCache: _BatchTrimHandler(),
    RotatingKVCache: _RotatingHandler(),
    BatchRotatingKVCache: _BatchRotatingHandler(),
    ArraysCache: _ArraysHandler(),
    CacheList: _CacheListHandler(),
}


def handler_for(cache: Any) -> Any:
    handler = HANDLERS.get(type(cache))
    if handler is None:
        supported = ", ".join(sorted(t.__name__ for t in HANDLERS))
        raise UnsupportedCache(
            f"speculative rounds cannot roll back a {type(cache).__module__}.{type(cache).__name__} exactly; "
            f"supported cache types: {supported}"
        )
    return handler


def check_supported(caches: Sequence[Any]) -> None:
    for c in caches:
        handler_for(c)
        if isinstance(c, CacheList):
            check_supported(c.caches)


def _is_ragged(handler: Any, cache: Any) -> bool:
    if isinstance(handler, _CacheListHandler):
        return handler.children_ragged(cache)
    return bool(getattr(handler, "ragged", False))


def _needs_replay(handler: Any, cache: Any, token: Any, n: Lengths, written: Optional[int]) -> bool:
    check = getattr(handler, "needs_replay", None)
    return bool(check(cache, token, n, written)) if check is not None else False


def _max_written(items: Any) -> Optional[int]:
    known = [w for w in (getattr(h, "written", lambda c, t: None)(c, t) for h, c, t in items) if w is not None]
    return max(known) if known else None


def _arrays_items(handlers: Sequence[Any], caches: Sequence[Any], tokens: Sequence[Any]) -> List[Tuple[Any, Any, Any]]:
    """(handler, cache, token) of every ArraysCache, CacheList children included."""
    out = []
    for h, c, t in zip(handlers, caches, tokens):
        if isinstance(h, _ArraysHandler):
            out.append((h, c, t))
        elif isinstance(h, _CacheListHandler):
            out += _arrays_items([x for x, _ in t], c.caches, [y for _, y in t])
    return out


def _taped(token: Any) -> int:
    if isinstance(token, _ArraysState):
        return int(token.taped)
    if isinstance(token, list):  # CacheList: (handler, token) per child
        return sum(_taped(t) for _, t in token)
    return 0


Replay = Callable[[int], Any]


class CacheTransaction:
    """Wraps one verify (or draft) forward over ``caches``.

    ``replay(n)`` feeds the first n positions of the forward again through the model's ordinary
    forward on these caches; it is needed only by recurrent caches (ArraysCache) whose forward the
    innovation tape could not record, and is called after every cache was restored to the start,
    so nothing is updated twice.

    Use as a context manager: an exception inside aborts, restoring the exact start state.
    """

    def __init__(self, caches: Sequence[Any], replay: Optional[Replay] = None):
        self.caches = list(caches)
        self.replay = replay
        self._handlers = [handler_for(c) for c in self.caches]
        self._starts: Optional[List[Any]] = None
        self.replayed = 0  # positions fed again by the last commit (0: none)
        self.taped = 0  # recurrent caches the last commit set through the innovation tape

    @property
    def ragged(self) -> bool:
        """Whether ``commit`` takes unequal per-row lengths (else the rows must commit the minimum)."""
        return all(_is_ragged(h, c) for h, c in zip(self._handlers, self.caches))

    def begin(self) -> "CacheTransaction":
        self._starts = [h.begin(c) for h, c in zip(self._handlers, self.caches)]
        return self

    def written(self) -> Optional[int]:
        """Positions written since ``begin`` (None when only recurrent caches are held)."""
        assert self._starts is not None, "written() outside a transaction"
        return _max_written(zip(self._handlers, self.caches, self._starts))

    def commit(self, n: Lengths, written: Optional[int] = None) -> None:
        """Keep the first n positions written since ``begin`` (n per row for batched caches).

        ``written``: how many positions the forward fed, when the caller knows it (needed to
        recognise a full commit when every cache is recurrent).
        """
        assert self._starts is not None, "commit() outside a transaction"
        if not isinstance(n, int):
            n = [int(v) for v in n]
            if _uniform(n) is not None:
                n = _uniform(n)
            elif not self.ragged:
                self.abort()
                kinds = sorted({type(c).__name__ for h, c in zip(self._handlers, self.caches) if not _is_ragged(h, c)})
                raise UnsupportedCache(
                    f"per-row commit lengths {n} need caches that commit ragged rows; {', '.join(kinds)} need the "
                    "same length for every row (commit the minimum)"
                )
        if written is None:
            written = self.written()
        if written is not None and not all(0 <= v <= written for v in ([n] if isinstance(n, int) else n)):
            self.abort()
            raise ValueError(f"cannot keep {n} positions: the forward wrote {written}; the caches were restored")
        starts, self._starts = self._starts, None
        self.replayed = self.taped = 0
        try:
            replay = any(
                _needs_replay(h, c, s, n, written) for h, c, s in zip(self._handlers, self.caches, starts)
            )
        except BaseException:
            self._abort(starts)
            raise
        if not replay:
            # Recurrent caches kept through the tape: their partial recurrences run together.
            taped = [(t, h.tape_request(c, t, n)) for h, c, t in _arrays_items(self._handlers, self.caches, starts)]
            taped = [(t, r) for t, r in taped if r is not None]
            try:
                apply_all([r for _, r in taped])
            except BaseException:
                self._abort(starts)
                raise
            for t, _ in taped:
                t.taped = True
            for h, c, s in zip(self._handlers, self.caches, starts):
                h.commit(c, s, n)
            self.taped = sum(_taped(s) for s in starts)
            return
        self._abort(starts)
        if self.replay is None:
            kinds = sorted({type(c).__name__ for h, c, s in zip(self._handlers, self.caches, starts)
                            if _needs_replay(h, c, s, n, written)})
            raise UnsupportedCache(
                f"keeping {n} of {written} positions of {', '.join(kinds)} needs a replay of the kept tokens, "
                "and this transaction was given no replay callback; the caches were restored to the start"
            )
        self.replay(int(n))
        self.replayed = int(n)

    def _abort(self, starts: List[Any]) -> None:
        for h, c, s in zip(self._handlers, self.caches, starts):
            h.abort(c, s)

    def abort(self) -> None:
        if self._starts is None:
            return
        starts, self._starts = self._starts, None
        self._abort(starts)

    def __enter__(self) -> "CacheTransaction":
        return self.begin()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None or self._starts is not None:
            self.abort()
