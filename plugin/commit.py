"""Committing a round: cache transactions. The verify forward writes B positions; ``commit(n)`` keeps the first n.

Every cache must end exactly as if only the kept tokens had been fed one at a time. Each cache
type has a handler; a type without one is refused by name, never guessed at.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from mlx_lm.models.cache import KVCache, QuantizedKVCache


class UnsupportedCache(TypeError):
    pass


class _TrimHandler:
    """Caches whose positions are a prefix of an array: drop the tail with ``trim``."""

    def begin(self, cache: Any) -> int:
        return cache.offset

    def commit(self, cache: Any, start: int, n: int) -> None:
        written = cache.offset - start
        assert 0 <= n <= written, (n, written)
        cache.trim(written - n)

    def abort(self, cache: Any, start: int) -> None:
        cache.trim(cache.offset - start)


HANDLERS: Dict[type, Any] = {
    KVCache: _TrimHandler(),
    QuantizedKVCache: _TrimHandler(),
}


def handler_for(cache: Any) -> Any:
    handler = HANDLERS.get(type(cache))
    if handler is None:
        supported = ", ".join(sorted(t.__name__ for t in HANDLERS))
        raise UnsupportedCache(
            f"speculative rounds cannot roll back a {type(cache).__name__} exactly; supported cache types: {supported}"
        )
    return handler


def check_supported(caches: Sequence[Any]) -> None:
    for c in caches:
        handler_for(c)


class CacheTransaction:
    """Wraps one verify (or draft) forward over ``caches``.

    Use as a context manager: an exception inside aborts, restoring the exact start state.
    """

    def __init__(self, caches: Sequence[Any]):
        self.caches = list(caches)
        self._handlers = [handler_for(c) for c in self.caches]
        self._starts: Optional[List[Any]] = None

    def begin(self) -> "CacheTransaction":
        self._starts = [h.begin(c) for h, c in zip(self._handlers, self.caches)]
        return self

    def commit(self, n: Union[int, Sequence[int]]) -> None:
        """Keep the first n positions written since ``begin`` (n per row for batched caches)."""
        assert self._starts is not None, "commit() outside a transaction"
        if not isinstance(n, int):
            raise UnsupportedCache("per-row commit lengths need batched caches, which this build does not roll back")
        for h, c, s in zip(self._handlers, self.caches, self._starts):
            h.commit(c, s, n)
        self._starts = None

    def abort(self) -> None:
        if self._starts is None:
            return
        for h, c, s in zip(self._handlers, self.caches, self._starts):
            h.abort(c, s)
        self._starts = None

    def __enter__(self) -> "CacheTransaction":
        return self.begin()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None or self._starts is not None:
            self.abort()
