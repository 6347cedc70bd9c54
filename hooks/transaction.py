"""Cache transactions: a forward writes W positions to a model's caches; ``commit(n)`` keeps the first n.

The host owns every cache (the target's, and the drafters' own), so it offers this one mechanism
to whoever runs forwards on them: the speculative round (verify + per-row acceptance), drafters
(their own caches), and anything that must try a forward and take part of it back. Every cache
must end exactly as if only the kept positions had been fed, and ``abort()`` gives back the exact
start state. Each cache type has a handler; a type without one is refused by name, never guessed
at (lookup is by exact type; a class of its own declares ``transaction_handler``).

How each cache type is rolled back, and why:

- KVCache, QuantizedKVCache, ConcatenateKVCache: positions are a prefix of an array: ``trim``.
- ChunkedKVCache: trim, but the model may drop the front inside the forward: abort restores the
  arrays kept at begin.
- BatchKVCache (rows of a batch, left-padded): per-row lengths. All rows share one write index, so
  the cache keeps max(n) positions and each shorter row is rolled right by what it rejects, the
  rejected tail becoming left padding: mlx-lm's own right-padding path (``prepare(right_padding=)``
  + ``finalize()``). Begin keeps the state by reference (``state``), so abort is exact even after a
  ragged commit inside the same transaction (a drafter trims its context per row mid-round).
- RotatingKVCache, BatchRotatingKVCache: ``rotating.py``.
- ArraysCache (recurrent / conv / SSM state): ``recurrent.py``.
- CacheList: each child by its own handler.

Handlers are plain objects with ``begin(cache) -> token``, ``commit(cache, token, n)``,
``abort(cache, token)``, ``written(cache, token) -> Optional[int]``, ``ragged`` (per-row ``n``), and
optionally ``needs_replay(cache, token, n, written)`` and ``partial(cache, token, n)`` (a recurrent
cache's partial commit, run for all recurrent caches of a transaction together).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
)

from .cache_ops import Lengths, UnsupportedCache, check_range, handle, uniform
from .recurrent import ArraysHandler, commit_partial
from .rotating import BatchRotatingHandler, RotatingHandler

__all__ = ["CacheTransaction", "UnsupportedCache", "HANDLERS", "handler_for", "check_supported", "Lengths"]

class TrimHandler:
    """Caches whose positions are a prefix of an array: drop the tail with ``trim``."""

    ragged = False

    def begin(self, cache: Any) -> int:
        return cache.offset

    def written(self, cache: Any, start: int) -> Optional[int]:
        return cache.offset - start

    def commit(self, cache: Any, start: int, n: Lengths) -> None:
        m, written = uniform(n), cache.offset - start
        if m is None:
            raise ValueError(f"a {type(cache).__name__} holds one row; got per-row lengths {list(n)}")
        check_range(cache, m, written)
        cache.trim(written - m)

    def abort(self, cache: Any, start: int) -> None:
        cache.trim(cache.offset - start)


class ChunkedHandler(TrimHandler):
    """ChunkedKVCache: trim, but the model may drop the front inside the forward; abort restores it."""

    def begin(self, cache: Any) -> Tuple[int, tuple]:
        start = (cache.keys, cache.values, cache.offset, cache.start_position)
        cache.keys, cache.values = handle(cache.keys), handle(cache.values)
        return cache.offset, start

    def written(self, cache: Any, token: Tuple[int, tuple]) -> Optional[int]:
        return cache.offset - token[0]

    def commit(self, cache: Any, token: Tuple[int, tuple], n: Lengths) -> None:
        super().commit(cache, token[0], n)

    def abort(self, cache: Any, token: Tuple[int, tuple]) -> None:
        cache.keys, cache.values, cache.offset, cache.start_position = token[1]


class BatchTrimHandler:
    """BatchKVCache: per-row commit lengths through mlx-lm's right-padding path (see module doc)."""

    ragged = True

    def begin(self, cache: Any) -> Tuple[int, tuple]:
        start = cache.state  # keys, values, offset, left_padding, size
        cache.keys, cache.values = handle(cache.keys), handle(cache.values)
        cache.offset, cache.left_padding = handle(cache.offset), handle(cache.left_padding)
        return cache.size(), start

    def written(self, cache: Any, token: Tuple[int, tuple]) -> Optional[int]:
        return cache.size() - token[0]

    def commit(self, cache: Any, token: Tuple[int, tuple], n: Lengths) -> None:
        written = cache.size() - token[0]
        rows = [int(n)] * cache.offset.shape[0] if isinstance(n, int) else [int(v) for v in n]
        if len(rows) != cache.offset.shape[0]:
            raise ValueError(f"per-row commit lengths {rows} do not fit a {type(cache).__name__} of "
                             f"{cache.offset.shape[0]} rows")
        check_range(cache, rows, written)
        keep = max(rows)
        cache.trim(written - keep)
        if keep > min(rows):
            cache.prepare(right_padding=[keep - v for v in rows])
            cache.finalize()

    def abort(self, cache: Any, token: Tuple[int, tuple]) -> None:
        cache.state = token[1]


class CacheListHandler:
    """CacheList (e.g. Falcon-H1's Mamba + attention per layer): each child by its own handler."""

    def begin(self, cache: Any) -> List[Tuple[Any, Any]]:
        return [(h, h.begin(c)) for h, c in zip((handler_for(c) for c in cache.caches), cache.caches)]

    def ragged_for(self, cache: Any) -> bool:
        return all(is_ragged(handler_for(c), c) for c in cache.caches)

    def written(self, cache: Any, token: List[Tuple[Any, Any]]) -> Optional[int]:
        return max_written((h, c, t) for (h, t), c in zip(token, cache.caches))

    def children(self, cache: Any, token: List[Tuple[Any, Any]]) -> List[Tuple[Any, Any, Any]]:
        return [(h, c, t) for (h, t), c in zip(token, cache.caches)]

    def commit(self, cache: Any, token: List[Tuple[Any, Any]], n: Lengths) -> None:
        for (h, t), c in zip(token, cache.caches):
            h.commit(c, t, n)

    def abort(self, cache: Any, token: List[Tuple[Any, Any]]) -> None:
        for (h, t), c in zip(token, cache.caches):
            h.abort(c, t)


def handler_for(cache: Any) -> Any:
    """The handler of ``cache``'s exact type, or the ``transaction_handler`` its class declares."""
    handler = HANDLERS.get(type(cache)) or getattr(type(cache), "transaction_handler", None)
    if handler is None:
        supported = ", ".join(sorted(t.__name__ for t in HANDLERS))
        raise UnsupportedCache(
            f"speculative rounds cannot roll back a {type(cache).__module__}.{type(cache).__name__} exactly; "
            f"supported cache types: {supported} (or a class declaring transaction_handler)"
        )
    return handler


def check_supported(caches: Sequence[Any]) -> None:
    """Raise ``UnsupportedCache`` naming the first cache no transaction can roll back."""
    for c in caches:
        handler_for(c)
        if isinstance(c, CacheList):
            check_supported(c.caches)


def is_ragged(handler: Any, cache: Any) -> bool:
    if isinstance(handler, CacheListHandler):
        return handler.ragged_for(cache)
    return bool(getattr(handler, "ragged", False))


def max_written(items: Any) -> Optional[int]:
    known = [w for w in (h.written(c, t) for h, c, t in items) if w is not None]
    return max(known) if known else None


def leaves(items: Sequence[Tuple[Any, Any, Any]]) -> List[Tuple[Any, Any, Any]]:
    """(handler, cache, token) of every cache, CacheList children in place of their list."""
    out: List[Tuple[Any, Any, Any]] = []
    for h, c, t in items:
        out += leaves(h.children(c, t)) if isinstance(h, CacheListHandler) else [(h, c, t)]
    return out


Replay = Callable[[Lengths], Any]


class CacheTransaction:
    """Wraps the forwards run on ``caches`` between ``begin`` and ``commit`` / ``abort``.

    ``replay(n)`` feeds the first n positions (per row: a list) again through the model's ordinary
    forward on these caches, after every cache was restored to the start; only recurrent caches
    whose forward could not be recorded need it (``recurrent.py``). Use as a context manager: an
    exception inside aborts.
    """

    def __init__(self, caches: Sequence[Any], replay: Optional[Replay] = None):
        self.caches = list(caches)
        self.replay = replay
        self._handlers = [handler_for(c) for c in self.caches]
        self._starts: Optional[List[Any]] = None
        self.replayed: Lengths = 0  # positions fed again by the last commit (0: none)
        self.taped = 0  # recurrent caches the last commit set from their recorded forward

    @property
    def ragged(self) -> bool:
        """Whether ``commit`` takes unequal per-row lengths."""
        return all(is_ragged(h, c) for h, c in zip(self._handlers, self.caches))

    def begin(self) -> "CacheTransaction":
        self._starts = [h.begin(c) for h, c in zip(self._handlers, self.caches)]
        return self

    @property
    def open(self) -> bool:
        return self._starts is not None

    def _items(self, starts: List[Any]) -> List[Tuple[Any, Any, Any]]:
        return list(zip(self._handlers, self.caches, starts))

    def written(self) -> Optional[int]:
        """Positions written since ``begin`` (None when no cache can tell, e.g. recurrent only)."""
        assert self._starts is not None, "written() outside a transaction"
        return max_written(self._items(self._starts))

    def exact(self, n: Lengths, written: Optional[int] = None) -> bool:
        """Whether ``commit(n)`` keeps unequal per-row lengths without replaying the model: a replay of
        rows of different lengths relies on every layer honouring mlx-lm's ``lengths``, which some
        recurrent layers (jamba's and mamba's own selective scans) do not. Equal lengths: always."""
        assert self._starts is not None, "exact() outside a transaction"
        if isinstance(n, int) or uniform(n) is not None:
            return True
        written = written if written is not None else self.written()
        return not any(getattr(h, "needs_replay", None) and h.needs_replay(c, t, list(n), written)
                       for h, c, t in leaves(self._items(self._starts)))

    def commit(self, n: Lengths, written: Optional[int] = None) -> None:
        """Keep the first n positions written since ``begin`` (a list: n per row of batched caches).

        ``written``: how many positions the forwards fed, when the caller knows it (needed to tell a
        full commit when every cache is recurrent).
        """
        assert self._starts is not None, "commit() outside a transaction"
        if not isinstance(n, int):
            n = [int(v) for v in n]
            n = uniform(n) if uniform(n) is not None else n
        if written is None:
            written = self.written()
        if written is not None and not all(0 <= v <= written for v in ([n] if isinstance(n, int) else n)):
            self.abort()
            raise ValueError(f"cannot keep {n} positions: the forward wrote {written}; the caches were restored")
        starts, self._starts = self._starts, None
        items = leaves(self._items(starts))
        self.replayed, self.taped = 0, 0
        try:
            replay = [h for h, c, t in items if getattr(h, "needs_replay", None) and h.needs_replay(c, t, n, written)]
            if not replay:
                self.taped = commit_partial([(h, c, t) for h, c, t in items if hasattr(h, "partial")], n, written)
                for h, c, t in self._items(starts):
                    h.commit(c, t, n)
                return
        except BaseException:
            self._abort(starts)
            raise
        self._abort(starts)
        if self.replay is None:
            kinds = sorted({type(c).__name__ for h, c, t in items if h in replay})
            raise UnsupportedCache(
                f"keeping {n} of {written} positions of {', '.join(kinds)} needs a replay of the kept tokens, "
                "and this transaction was given no replay callback; the caches were restored to the start"
            )
        self.replay(n)
        self.replayed = n

    def _abort(self, starts: List[Any]) -> None:
        for h, c, s in self._items(starts):
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



HANDLERS: Dict[type, Any] = {
    KVCache: TrimHandler(), QuantizedKVCache: TrimHandler(), ConcatenateKVCache: TrimHandler(),
    ChunkedKVCache: ChunkedHandler(), BatchKVCache: BatchTrimHandler(), RotatingKVCache: RotatingHandler(),
    BatchRotatingKVCache: BatchRotatingHandler(), ArraysCache: ArraysHandler(), CacheList: CacheListHandler(),
}
