"""The rows of one batch drafting with a Gemma 4 assistant (``AssistantBatch``): no cache of its own.

Each draft step is one assistant forward for every row. The assistant attends over the K/V the
target's caches hold (``DecodeState.batch`` -> ``hooks.kv_view``): between steps they hold exactly
every committed position < P of each row (P: its pending token), which is what the assistant reads
at the query position P. What it keeps per row is the target's final hidden state at P-1 (after the
final norm), from the host's taps (prefill, plain steps) and each verify (``Verified.captures``).

The server's prompt cache needs nothing of it: a row restored from the cache reads the target's
restored K/V, and the host feeds at least its prompt's last token, whose capture is the hidden state
at P-1. ``export_row`` says so (a state of no bytes covering every position); ``restore_row`` keeps
nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx

from ...hooks.api import KVView
from ..base import DraftBatch, Drafter, DraftState, Proposal
from .batch import RowBook, draw, proposals


def masks(views: Dict[str, KVView], pending: mx.array, window: int) -> Dict[str, mx.array]:
    """Per layer type [B, 1, 1, S]: the keys a query at each row's pending position P reads. Every
    stored position < P for full attention; within the window (P - pos < window) for sliding."""
    out = {}
    for kind, view in views.items():
        pos = view.positions  # [B, S]
        ok = (pos >= 0) & (pos < pending[:, None])
        if kind == "sliding_attention":
            ok = ok & (pending[:, None] - pos < window)
        out[kind] = ok[:, None, None, :]
    return out


class AssistantBatch(RowBook):
    def __init__(self, drafter: "AssistantDrafter"):
        super().__init__(drafter)
        self.hidden: Dict[int, mx.array] = {}  # id(row) -> [1, 1, H_target] final hidden state at P-1
        self.read: Dict[str, KVView] = {}  # the target K/V the last propose attended over (per layer type)

    def prepare(self, rows: Sequence[Any]) -> None:
        self.rows, self.fresh = list(rows), []
        present = {id(r) for r in rows}
        self.hidden = {k: v for k, v in self.hidden.items() if k in present}
        for row in rows:
            h = self.take_hidden(row)
            if h is not None:
                self.hidden[id(row)] = h[:, -1:]

    def shared(self, rows: Sequence[Any]) -> Dict[str, KVView]:
        """The target's committed K/V per layer type, for these rows (in their order)."""
        batch = rows[0].batch
        if batch is None or any(r.batch is not batch for r in rows):
            raise RuntimeError("the assistant's rows must decode in one batch (state.batch)")
        index = [next(i for i, s in enumerate(batch.rows) if s is r) for r in rows]
        views = {}
        for kind, layer in self.drafter.kv_layers.items():
            view = batch.committed_kv(layer)
            if view is None:
                raise RuntimeError(f"the target's layer {layer} ({kind}) holds no K/V yet")
            views[kind] = view if index == list(range(len(batch.rows))) else view.rows(mx.array(index))
        return views

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        d = self.drafter
        counts = [self.row_depth(r).allowed(m) if id(r) in self.hidden and len(r.tokens) > 1 else 0
                  for r, m in zip(rows, max_drafts)]
        k = max(counts, default=0)
        if k == 0:
            return [Proposal([]) for _ in rows]
        self.read = views = self.shared(rows)
        pending = mx.array([len(r.tokens) - 1 for r in rows], dtype=mx.int32)  # [B] the query position P
        mask = masks(views, pending, d.window)
        shared = {kind: (v.keys.astype(d.dtype), v.values.astype(d.dtype)) for kind, v in views.items()}
        some = next(iter(self.hidden.values()))
        h = mx.concatenate([self.hidden.get(id(r), mx.zeros_like(some)) for r in rows], axis=0).astype(d.dtype)  # [B, 1, Ht]
        token = mx.array([r.pending for r in rows], dtype=mx.uint32)  # [B]
        steps = []
        for _ in range(k):
            x = mx.concatenate([d.embed(token[:, None]).astype(d.dtype), h], axis=-1)  # [B, 1, 2 * Ht]
            h, state = d.model(x, shared, mask, pending)
            self.forwards += 1
            token, q = draw(rows, d.model.logits(state)[:, 0], len(steps))  # [B]
            steps.append((token, q))
            token = token.astype(mx.uint32)
        return proposals(steps, counts)

    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        return DraftState(positions, None, 0) if positions > 0 else None

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        return True  # the first round reads the hidden state the host captures at the prompt's last token


class AssistantDrafter(Drafter):
    """A loaded Gemma 4 assistant on one target."""

    kind = "mtp"
    family = "gemma4_assistant"

    def __init__(self, model: Any, embed: Callable[[mx.array], mx.array], final_norm: Callable[[mx.array], mx.array],
                 hidden_layer: int, kv_layers: Dict[str, int], window: int, block_size: int):
        self.model = model
        self.embed = embed  # the target's input embedding, scaled as its forward scales it
        self.final_norm = final_norm
        self.hidden_layer = hidden_layer
        self.kv_layers = kv_layers  # layer type -> index of the target's cache it reads
        self.window = window
        self.default_block_size = block_size
        self.dtype = model.pre_projection.weight.dtype

    def capture_layers(self) -> List[int]:
        return [self.hidden_layer]

    def new_batch(self) -> DraftBatch:
        return AssistantBatch(self)


def target_kv_layers(layer_types: Sequence[str], num_kv_shared: int) -> Dict[str, int]:
    """Per layer type, the target's last layer of that type that keeps its own K/V (the ones its
    KV-shared layers read, and the cache index that holds them)."""
    own = len(layer_types) - int(num_kv_shared or 0)
    out: Dict[str, int] = {}
    for i, kind in enumerate(layer_types[:own]):
        out[kind] = i
    return out

