"""A batch of requests of one target decoded together: its rows, its caches, the target's forward.

Every decode step is one forward of the target for all rows (the CLI's single request is a batch
of one). A row joins after its own prefill: its caches merge into the batch's through the cache
classes' own ``merge`` / ``extend`` (mlx-lm's ``BatchKVCache``, ``BatchRotatingKVCache``,
``ArraysCache``, ``CacheList``; left padding for shorter rows), and leaves with ``filter``. A batch
of one row keeps the row's own caches (``KVCache``: mask-free one-token steps, as mlx-lm's
``generate_step``), and a batch that shrinks to one row ``extract``s them back. Caches without
``merge`` (quantized, chunked) decode in batches of one through the same code (``single``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, CacheList

from . import taps
from .kv_view import KVView, committed_kv
from .state import DecodeState, LoadedTarget

Inputs = Union[mx.array, Sequence[Sequence[int]]]


def mergeable(caches: Sequence[Any]) -> bool:
    """Whether rows with these caches can share a batch (every layer's cache class has ``merge``)."""
    return bool(caches) and all(callable(getattr(type(c), "merge", None)) for c in caches)


def merge_rows(rows: Sequence[Sequence[Any]]) -> List[Any]:
    """One batched cache per layer out of per-row cache lists (each row a list of plain caches)."""
    return [type(row_caches[0]).merge(list(row_caches)) for row_caches in zip(*rows)]


def extend_rows(batched: List[Any], new: List[Any]) -> None:
    """Append the rows of ``new`` (batched caches) to ``batched``, layer by layer, in place."""
    for mine, theirs in zip(batched, new):
        mine.extend(theirs)


def extract_row(batched: Sequence[Any], index: int) -> List[Any]:
    """Row ``index`` of batched caches as a plain (one-row) cache per layer."""
    return [c.extract(index) for c in batched]


def filter_rows(batched: Sequence[Any], keep: Sequence[int]) -> None:
    indices = mx.array(list(keep))
    for c in batched:
        c.filter(indices)


def add_row(batched: List[Any], rows: int, caches: List[Any]) -> List[Any]:
    """The caches of ``rows`` rows with one more row's own (plain) caches after them: returns the
    caches to hold from now on (the row's own for the first row, else batched caches)."""
    if rows == 0:
        return caches
    if rows == 1:
        return merge_rows([batched, caches])
    extend_rows(batched, merge_rows([caches]))
    return batched


def keep_rows(caches: List[Any], keep: Sequence[int], before: int) -> List[Any]:
    """Only rows ``keep`` of ``before`` rows stay: batched caches filtered in place, a single row's
    own (plain) caches extracted, none left: []. Returns the caches to hold from now on."""
    if not keep:
        return []
    if len(keep) == 1 and before > 1:
        return extract_row(caches, keep[0])
    if len(keep) > 1:
        filter_rows(caches, keep)
    return caches


def forward(model: nn.Module, inputs: Inputs, cache: List[Any], layers: Sequence[int]) -> Tuple[mx.array, Dict[int, mx.array]]:
    """The target's ordinary forward: logits [B, W, V] and the tapped layers' outputs [B, W, H].

    The one place the host calls the target model (prefill, plain steps and plugins' rounds all
    come here). ``inputs``: a [B, W] integer array (may be lazy) or B token lists of one length.
    """
    if not isinstance(inputs, mx.array):
        inputs = mx.array([list(r) for r in inputs], dtype=mx.uint32)
    if inputs.shape[1] > 1:
        in_temporal_order(cache)
    with taps.record(layers) as rec:
        logits = model(inputs.astype(mx.uint32), cache=cache)
    return logits, {i: mx.concatenate(v, axis=1) if len(v) > 1 else v[0] for i, v in rec.items() if v}


def in_temporal_order(caches: Sequence[Any]) -> None:
    """Lay wrapped batched sliding-window caches out in temporal order before a multi-token forward.

    mlx-lm's ``BatchRotatingKVCache.make_mask`` (built before the update) takes the ring index for
    the length its multi-token update will trim, so once the ring has wrapped it masks one real key
    of each left-padded row too many (the update itself reorders first, then trims). Reordering
    first, with the cache's own ``_temporal_order``, makes mask and update agree; a cache
    transaction that began before keeps the wrapped state to restore."""
    for c in caches:
        if isinstance(c, CacheList):
            in_temporal_order(c.caches)
        elif isinstance(c, BatchRotatingKVCache) and c.rotated:
            c._temporal_order()


@dataclass
class PlainRuns:
    """The host's last run of plain steps on this batch (a plugin prices the steps by its own clock)."""

    steps: int = 0
    rows: int = 0
    runs: int = 0  # plain runs so far: a plugin tells a new one by it


class DecodeBatch:
    """The rows (``DecodeState``s of one target) decoded together, and their caches."""

    def __init__(self, target: LoadedTarget, single: bool = False):
        self.target = target
        self.single = single  # holds at most one row (seeded sampling rows, caches without merge)
        self.rows: List[DecodeState] = []
        self.cache: List[Any] = []  # per layer: the one row's own caches, or batched caches
        self.extras: Dict[str, Any] = {}  # plugins' per-batch state, under their own names
        self.plain = PlainRuns()
        self.version = 0  # bumped when rows join

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def capture_layers(self) -> List[int]:
        return sorted({i for s in self.rows for i in s.capture_layers})

    def accepts(self, caches: Sequence[Any]) -> bool:
        """Whether a row with these caches may join now."""
        return not self.rows or (not self.single and mergeable(caches) and mergeable(self.cache))

    def join(self, state: DecodeState, caches: List[Any]) -> None:
        """Add a prefilled row (its caches hold every token but ``pending``); the batch takes its caches."""
        if state.target is not self.target:
            raise ValueError("a row of another target cannot join this batch")
        if not self.accepts(caches):
            raise ValueError(f"this batch cannot take another row (single={self.single}, caches "
                             f"{sorted({type(c).__name__ for c in caches})})")
        if not self.rows:
            self.cache = list(caches)
        elif len(self.rows) == 1:
            self.cache = merge_rows([self.cache, caches])
        else:
            extend_rows(self.cache, merge_rows([caches]))
        self.rows.append(state)
        state.batch = self
        self.version += 1

    def leave(self, state: DecodeState) -> None:
        """Drop a row and its positions (a finished or cancelled request)."""
        i = next((j for j, s in enumerate(self.rows) if s is state), None)
        if i is None:
            return
        del self.rows[i]
        state.batch = None
        if not self.rows:
            self.cache = []
        elif len(self.rows) == 1:
            self.cache = extract_row(self.cache, 1 - i)
        else:
            filter_rows(self.cache, [j for j in range(len(self.rows) + 1) if j != i])

    def row_caches(self, state: DecodeState) -> List[Any]:
        """The caches of one row as plain one-row caches (the batch's own objects for a batch of one)."""
        i = next(j for j, s in enumerate(self.rows) if s is state)
        return list(self.cache) if len(self.rows) == 1 else extract_row(self.cache, i)

    def compact(self, at_least: int = 16) -> int:
        """Drop the left padding all rows share once it reaches ``at_least`` positions: returns how many.

        Ragged commits pad each row by what it rejects while the batch keeps the longest row's
        positions; the padding is never read (masked) but costs attention work and memory.
        ``BatchKVCache.filter`` shifts it off.
        """
        padded = [c for c in self.cache if isinstance(c, BatchKVCache)]
        if len(self.rows) < 2 or not padded:
            return 0
        pad = int(mx.min(padded[0].left_padding).item())
        if pad < at_least:
            return 0
        filter_rows(self.cache, range(len(self.rows)))
        return pad

    def take(self) -> List[Any]:
        """Empty a one-row batch, handing its row's caches back (a row's first step, then it moves)."""
        assert len(self.rows) == 1, "take() empties a one-row batch"
        self.rows[0].batch = None
        caches, self.cache, self.rows = self.cache, [], []
        return caches

    def committed_kv(self, layer: int) -> Optional[KVView]:
        """The committed K/V of the cache at ``layer`` of the target's cache list, with each slot's
        position per row (``hooks.kv_view``); None while it holds nothing. Read it between steps."""
        return committed_kv(self.cache[layer])

    def forward(self, inputs: Inputs) -> Tuple[mx.array, Dict[int, mx.array]]:
        """The target's ordinary forward over one equally long token list per row.

        Returns logits [B, W, V] and the tapped layers' outputs {layer: [B, W, H]} (the layers any
        row records). The caches take the W positions of every row; a caller that keeps fewer
        wraps the forward in a ``CacheTransaction`` over ``self.cache``. The backend's ``forward``
        (the same function, e.g. compiled: hooks/backend.py) answers first where it has one and takes the call.
        """
        width = inputs.shape[0] if isinstance(inputs, mx.array) else len(inputs)
        if width != len(self.rows):
            raise ValueError(f"expected {len(self.rows)} rows of inputs; got {width}")
        policy_forward = self.target.cache_policy.forward
        if policy_forward is not None and isinstance(inputs, mx.array):
            got = policy_forward(self.target.model, inputs, self.cache, self.capture_layers)
            if got is not None:
                return got
        return forward(self.target.model, inputs, self.cache, self.capture_layers)


def replay(model: nn.Module, cache: List[Any], inputs: mx.array, n: Union[int, Sequence[int]]) -> None:
    """Feed the first n positions of ``inputs`` [B, W] again (n per row: a list): how a cache
    transaction keeps part of a forward on caches it could not roll back by themselves (it has
    restored every cache first). Unequal rows go through mlx-lm's right-padding path
    (``prepare(lengths=, right_padding=)``, then ``finalize``), as its batch generator prefills."""
    rows = [n] * inputs.shape[0] if isinstance(n, int) else [int(v) for v in n]
    top = max(rows)
    if top == 0:
        return
    if min(rows) == top:
        forward(model, inputs[:, :top], cache, [])
        return
    for c in cache:
        c.prepare(lengths=rows, right_padding=[top - v for v in rows])
    forward(model, inputs[:, :top], cache, [])
    for c in cache:
        c.finalize()
