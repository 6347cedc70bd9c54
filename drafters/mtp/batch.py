"""The rows of one batch drafting with an MTP head that keeps its own KV cache (Qwen3.5 / Qwen3-Next
``mtp.*``, DeepSeek nextn): ``HeadBatch``. One head forward per draft step serves every row.

The head's cache holds one entry per committed position t < P (P: the row's pending token): the
pair (token t+1, the target's final hidden state at t) at position t, so the head's output at the
last entry (token P = the pending one) drafts token P+1. ``prepare`` appends the entries of the
positions committed since the last round (the target's hidden states come from the host's taps:
prefill, plain steps, and each verify through ``Verified.captures``). ``propose`` drafts token P+1
from that output and, for deeper drafts, applies the head again to its own output at positions
P, P+1, ...; those entries are rolled back with the round (commit keeps 0), since the committed
positions get entries made of the target's own hidden states at the next ``prepare``.

``Depth``: the checkpoint's depth is what the head was made for; a larger block applies the head
recursively, and rows stop doing so while the recursive drafts do not get accepted.

The server's prompt cache keeps a row's head cache and the normed hidden states of every position
(``export_row``; entry t also holds token t + 1, so a request sharing n tokens keeps entries
0..n-2 and makes entry n-1 again with its own token n: ``drafters/feature_log.py``). A row restored
from it (``restore_row``) makes only the entries after them, its seed the output at its last one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ...hooks.api import CacheTransaction, DraftBackend, add_row, keep_rows
from ..base import DraftBatch, Drafter, DraftState, Proposal, Verified
from .. import feature_log
from ..feature_log import FeatureLog

WINDOW = 8  # rounds a depth decision looks at
STOP_BELOW = 0.35  # recursive drafting stops when the first recursive draft is accepted less often
RETRY_ABOVE = 0.65  # ... and resumes once rounds at the checkpoint's depth accept all of it this often


@dataclass
class Depth:
    """Drafts per round for one row: the request's, or at most ``trained`` while recursion does not pay."""

    trained: int  # the checkpoint's depth
    capped: bool = False
    recent: Deque[Tuple[int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def allowed(self, requested: int) -> int:
        return min(requested, self.trained) if self.capped else requested

    def record(self, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        deeper = drafted > self.trained
        if deeper == self.capped:  # a round of the other regime (e.g. near the end): ignored
            return
        self.recent.append((accepted, drafted))
        if len(self.recent) < WINDOW:
            return
        if not self.capped and sum(a > self.trained for a, _ in self.recent) / WINDOW < STOP_BELOW:
            self.capped = True
            self.recent.clear()
        elif self.capped and sum(a >= self.trained for a, _ in self.recent) / WINDOW >= RETRY_ABOVE:
            self.capped = False
            self.recent.clear()


class RowBook(DraftBatch):
    """Rows in batch order, the target hidden states not yet consumed, and each row's depth."""

    rows_draft_together = True  # one forward a draft step for every row

    def __init__(self, drafter: Any):
        self.drafter = drafter
        self.rows: List[Any] = []  # DecodeStates in cache-row order (rows made already)
        self.fresh: List[Any] = []  # rows seen, not made yet
        self.pending: Dict[int, List[mx.array]] = {}  # id(row) -> [1, n, H] target hidden states (raw taps)
        self.depth: Dict[int, Depth] = {}

    def sync(self, rows: Sequence[Any]) -> None:
        present = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.rows) if id(r) in present]
        if len(keep) < len(self.rows):
            self.keep_rows(keep)
            self.rows = [self.rows[b] for b in keep]
        self.fresh = [r for r in self.fresh if id(r) in present]
        known = {id(r) for r in self.rows + self.fresh}
        self.fresh += [r for r in rows if id(r) not in known]
        self.pending = {k: v for k, v in self.pending.items() if k in present}
        self.depth = {k: v for k, v in self.depth.items() if k in present}
        layer = self.drafter.hidden_layer
        for row in rows:
            if layer in row.captures:  # what the host fed since the last step (prefill, plain steps)
                self.pending.setdefault(id(row), []).append(row.captures[layer])

    def keep_rows(self, keep: List[int]) -> None:
        """Rows not in ``keep`` (cache-row indices) left the batch."""

    def take_hidden(self, row: Any) -> Optional[mx.array]:
        """[1, n, H] the row's pending target hidden states after the target's final norm, or None."""
        return self.normed(self.pending.pop(id(row), []))

    def normed(self, parts: List[mx.array]) -> Optional[mx.array]:
        if not parts:
            return None
        h = mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return self.drafter.final_norm(h)

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        layer = self.drafter.hidden_layer
        for row, v in zip(rows, verified):
            if layer in v.captures:
                self.pending.setdefault(id(row), []).append(v.captures[layer])
            self.row_depth(row).record(v.accepted, v.drafted)
        return [0] * len(rows)

    def row_depth(self, row: Any) -> Depth:
        return self.depth.setdefault(id(row), Depth(self.drafter.default_block_size - 1))

    def check_order(self, rows: Sequence[Any]) -> None:
        order = {id(r): b for b, r in enumerate(self.rows)}
        if [order.get(id(r)) for r in rows] != list(range(len(self.rows))):
            raise RuntimeError("MTP rows must keep the batch's order")


def draw(rows: Sequence[Any], logits: mx.array, offset: int) -> Tuple[mx.array, List[Optional[mx.array]]]:
    """One draft token per row from logits [B, V]: greedy rows take the argmax; sampling rows draw
    from q, the softmax of the logits through the request's sampling filters (``SamplingParams.process``), by
    ``DecodeState.draw_drafts`` at block position ``offset``. Returns (tokens [B], per row log q [V] or None)."""
    logits = logits.astype(mx.float32)
    if all(r.sampling.greedy for r in rows):
        return mx.argmax(logits, axis=-1), [None] * len(rows)
    tokens, qs = [], []
    for b, row in enumerate(rows):
        if row.sampling.greedy:
            tokens.append(mx.argmax(logits[b], axis=-1))
            qs.append(None)
            continue
        logq = row.sampling.process(logits[b] - mx.logsumexp(logits[b], axis=-1, keepdims=True))  # [V]
        tokens.append(row.draw_drafts(logq, offset))
        qs.append(logq)
    return mx.stack(tokens), qs


def proposals(steps: List[Tuple[mx.array, List[Optional[mx.array]]]], counts: Sequence[int]) -> List[Proposal]:
    """Per row: its first counts[b] drafts of the steps' draws, with their q where sampled."""
    if not steps:
        return [Proposal([]) for _ in counts]
    tokens = mx.stack([t for t, _ in steps], axis=1)  # [B, k]
    out = []
    for b, m in enumerate(counts):
        qs = [q[b] for _, q in steps[:m]]
        logq = mx.stack(qs) if m and qs[0] is not None else None  # [m, V]
        out.append(Proposal(tokens[b, :m], logq) if m else Proposal([]))
    # Queued, not awaited: the round builds its verify forward while the drafts compute.
    mx.async_eval(tokens, [p.logprobs for p in out if p.logprobs is not None])
    return out


class HeadBatch(RowBook):
    """The head's KV caches for the rows of one batch and each row's output at its last entry."""

    def __init__(self, drafter: "HeadDrafter"):
        super().__init__(drafter)
        self.context: List[int] = []  # entries in each row's head cache
        self.cache: List[Any] = []  # per head layer: one row's own cache, or batched caches
        self.seeds: List[Optional[mx.array]] = []  # per row: [1, 1, H] output at its last entry
        self.log = FeatureLog()  # per row: [1, n, H] the normed hidden states of its entries
        # id(row) -> (caches holding c entries, c, [1, n, H] normed hidden states of its first n positions)
        self.restored: Dict[int, Tuple[List[Any], int, mx.array]] = {}

    def sync(self, rows: Sequence[Any]) -> None:
        super().sync(rows)
        present = {id(r) for r in rows}
        self.restored = {k: v for k, v in self.restored.items() if k in present}
        self.log.keep(present)

    def keep_rows(self, keep: List[int]) -> None:
        before = len(self.rows)
        self.context = [self.context[b] for b in keep]
        self.seeds = [self.seeds[b] for b in keep]
        self.cache = keep_rows(self.cache, keep, before)

    def _entries(self, row: Any, start: int, hidden: mx.array) -> mx.array:
        """[1, n, H] embeddings of tokens start+1 .. start+n, paired with ``hidden`` [1, n, H]."""
        n = hidden.shape[1]
        return self.drafter.embed(mx.array([row.tokens[start + 1 : start + 1 + n]], dtype=mx.uint32))

    def prepare(self, rows: Sequence[Any]) -> None:
        d = self.drafter
        for row in self.fresh:  # a row's first entries (its whole prompt) are made alone, then merged
            caches, start, known = self.restored.pop(id(row), None) or (d.make_cache(), 0, None)
            hidden = self.take_hidden(row)
            if known is not None:  # restored: the positions its caches hold no entry for come first
                if start:
                    self.log.append(row, known[:, :start])
                hidden = known[:, start:] if hidden is None else mx.concatenate([known[:, start:], hidden], axis=1)
            n = 0 if hidden is None else hidden.shape[1]
            seed = None
            if n:
                out = d.model(self._entries(row, start, hidden).astype(hidden.dtype), hidden, caches)  # [1, n, H]
                seed = out[:, -1:]
                self.log.append(row, hidden)
            self.cache = add_row(self.cache, len(self.rows), caches)
            self.rows.append(row)
            self.context.append(start + n)
            self.seeds.append(seed)
        self.fresh = []
        self.check_order(rows)
        hidden = [self.take_hidden(r) for r in self.rows]
        for row, h in zip(self.rows, hidden):
            if h is not None:
                self.log.append(row, h)
        counts = [0 if h is None else h.shape[1] for h in hidden]
        if max(counts, default=0) > 0:
            width = max(counts)
            H = next(h.shape[2] for h in hidden if h is not None)
            dtype = next(h.dtype for h in hidden if h is not None)
            pad = lambda x, c: x if c == width else mx.concatenate([x, mx.zeros((1, width - c, H), dtype)], axis=1)  # noqa: E731
            hs = mx.concatenate([pad(h, c) if h is not None else mx.zeros((1, width, H), dtype)
                                 for h, c in zip(hidden, counts)], axis=0)  # [B, width, H]
            es = mx.concatenate([pad(self._entries(r, s, h).astype(dtype), c) if h is not None else mx.zeros((1, width, H), dtype)
                                 for r, s, h, c in zip(self.rows, self.context, hidden, counts)], axis=0)
            with CacheTransaction(self.cache) as txn:  # right-padded rows: each keeps its own count
                out = d.model(es, hs, self.cache)  # [B, width, H]
                txn.commit(counts, written=width)
            self.forwards += 1
            for b, c in enumerate(counts):
                if c:
                    self.seeds[b] = out[b : b + 1, c - 1 : c]
        self.context = [c + n for c, n in zip(self.context, counts)]
        mx.async_eval(self.log.arrays())  # queued: the round goes on meanwhile
        for row, c in zip(self.rows, self.context):
            if c != len(row.tokens) - 1:
                raise RuntimeError(f"MTP head out of step: {c} entries in its cache, but the target has "
                                   f"consumed {len(row.tokens) - 1} positions")

    def cache_groups(self) -> List[Tuple[List[Any], List[int]]]:
        return [(self.cache, list(range(len(self.rows))))] if self.cache else []

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        d = self.drafter
        counts = [self.row_depth(r).allowed(m) if s is not None else 0
                  for r, m, s in zip(rows, max_drafts, self.seeds)]
        k = max(counts, default=0)
        if k == 0:
            return [Proposal([]) for _ in rows]
        H = next(s.shape[-1] for s in self.seeds if s is not None)
        dtype = next(s.dtype for s in self.seeds if s is not None)
        h = mx.concatenate([s if s is not None else mx.zeros((1, 1, H), dtype) for s in self.seeds], axis=0)  # [B, 1, H]
        steps = []
        for i in range(k):
            if i:  # the head again, on its own output and the draft it just made (position P + i - 1)
                h = d.model(d.embed(steps[-1][0][:, None].astype(mx.uint32)).astype(dtype), h, self.cache)
                self.forwards += 1
            steps.append(draw(rows, d.logits(h)[:, 0], i))  # logits [B, V]
        return proposals(steps, counts)

    # the prompt cache -----------------------------------------------------------------------------
    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        layer = self.drafter.hidden_layer
        parts = self.pending.get(id(row), []) + ([row.captures[layer]] if layer in row.captures else [])
        return feature_log.export_row(self, row, positions, self.normed(parts))

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        return feature_log.restore_row(self, row, saved, n)


class HeadDrafter(Drafter):
    """A loaded MTP head with its own KV cache, on one target."""

    kind = "mtp"

    def __init__(self, family: str, model: Any, embed: Callable[[mx.array], mx.array],
                 logits: Callable[[mx.array], mx.array], final_norm: Callable[[mx.array], mx.array],
                 hidden_layer: int, block_size: int, backend: Optional[DraftBackend] = None):
        self.family = family
        self.model = model  # (embeds, hidden, cache) -> the state the next step and ``logits`` read
        self.embed = embed  # the target's input embedding
        self.logits = logits  # head state [B, L, H] -> logits [B, L, V]
        self.final_norm = final_norm  # the target's: its last layer's output -> its final hidden state
        self.hidden_layer = hidden_layer
        self.default_block_size = block_size
        self.backend = backend or DraftBackend()  # the target's backend, as drafters see it (hooks/backend.py)

    def capture_layers(self) -> List[int]:
        return [self.hidden_layer]

    def make_cache(self) -> List[Any]:
        return self.model.make_cache(self.backend.kv_cache)

    def new_batch(self) -> DraftBatch:
        return HeadBatch(self)
