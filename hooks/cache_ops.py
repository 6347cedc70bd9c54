"""Small helpers shared by the cache-transaction handlers (``transaction``, ``rotating``, ``recurrent``), and
``zeroed`` for the prewarms (plugin/cuda/backend.py, drafters)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import mlx.core as mx

Lengths = Union[int, Sequence[int]]


class UnsupportedCache(TypeError):
    """A cache (or a forward on it) that cannot be rolled back exactly."""


def handle(x: Optional[mx.array]) -> Optional[mx.array]:
    """A new array object sharing ``x``'s data: in-place writes (``a[i] = v``, ``a += 1``) to it
    copy instead of reaching ``x``, so a reference kept at begin stays the start state."""
    return None if x is None else mx.stop_gradient(x)


def zeroed(caches: Sequence[Any], shapes: Sequence[Any], length: int, offset: int) -> None:
    """Give each cache zero buffers of ``length`` positions (``shapes``: its (keys shape, values shape, dtype))
    and ``offset``: the state a forward warming that key length starts from."""
    for c, (ks, vs, dt) in zip(caches, shapes):
        c.keys = mx.zeros((ks[0], ks[1], length, ks[3]), dt)
        c.values = mx.zeros((vs[0], vs[1], length, vs[3]), dt)
        c.offset = offset


def uniform(n: Lengths) -> Optional[int]:
    """n itself, or the common value of per-row lengths (None when they differ)."""
    if isinstance(n, int):
        return n
    values = [int(v) for v in n]
    return values[0] if values and all(v == values[0] for v in values) else None


def check_range(cache: Any, n: Lengths, written: int) -> None:
    """Raise ValueError unless every length in ``n`` lies in [0, written]: a rollback cannot keep
    positions a cache never wrote."""
    rows = [n] if isinstance(n, int) else list(n)
    if not all(0 <= int(v) <= written for v in rows):
        raise ValueError(f"cannot keep {n} of the {written} positions written to a {type(cache).__name__}")
