"""The rows of one batch drafting with an EAGLE-3 drafter (``Eagle3Batch``).

Drafter position j pairs the target's features of position j with the token at j + 1, so a row
whose target has consumed positions 0..n-1 (``row.tokens[n]`` pending) has n drafter positions
once caught up, and the output state at the last one gives the first draft. ``prepare`` feeds the
positions committed since the last round with the target's own features (one forward for every
row, kept whatever the round decides): its last output is draft step 1. ``propose`` then chains
k - 1 more steps, each one forward for every row, the drafter feeding its own state forward;
those positions are written inside the round's transaction and all rolled back at ``commit``
(the accepted ones come back next round with the target's real features, as in EAGLE).

The server's prompt cache keeps a row's drafter caches and the projected features of every
position (``export_row``; drafter position j also holds token j + 1, so a request sharing n tokens
keeps positions 0..n-2 and makes position n-1 again from its features with its own token n:
``drafters/feature_log.py``). A row restored from it (``restore_row``) feeds only the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ...hooks.api import CacheTransaction, add_row, keep_rows
from ..base import DraftBatch, DraftState, Proposal, Verified
from .. import feature_log
from ..feature_log import FeatureLog

if TYPE_CHECKING:
    from . import Eagle3Drafter


class Eagle3Batch(DraftBatch):
    rows_draft_together = True  # one forward a draft step for every row

    def __init__(self, drafter: "Eagle3Drafter"):
        self.drafter = drafter
        self.rows: List[Any] = []  # DecodeStates in cache-row order
        self.context: List[int] = []  # drafter positions per row
        self.pending: Dict[int, List[Dict[int, mx.array]]] = {}  # id(row) -> captures not yet fed
        self.fresh: List[Any] = []  # rows seen, their prompt not fed yet
        self.cache: List[Any] = []  # per drafter layer: one row's own cache, or batched caches
        self.last: Optional[mx.array] = None  # [B, 1, H] raw output state at each row's last position
        self.ready: List[bool] = []  # the row has a last position (a prompt of one token has none at first)
        self.prefills = 0  # forwards over a new row's prompt (not draft steps)
        self.log = FeatureLog()  # per row: [1, n, H] projected features of its drafter positions
        # id(row) -> (caches holding c positions, c, [1, n, H] projected features of its first n positions)
        self.restored: Dict[int, Tuple[List[Any], int, mx.array]] = {}

    def sync(self, rows: Sequence[Any]) -> None:
        present = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.rows) if id(r) in present]
        if len(keep) < len(self.rows):
            before = len(self.rows)
            self.rows = [self.rows[b] for b in keep]
            self.context = [self.context[b] for b in keep]
            self.ready = [self.ready[b] for b in keep]
            self.last = self.last[mx.array(keep)] if keep else None
            self.cache = keep_rows(self.cache, keep, before)
        self.fresh = [r for r in self.fresh if id(r) in present]
        known = {id(r) for r in self.rows + self.fresh}
        self.fresh += [r for r in rows if id(r) not in known]
        self.pending = {k: v for k, v in self.pending.items() if k in present}
        self.restored = {k: v for k, v in self.restored.items() if k in present}
        self.log.keep(present)
        for row in rows:
            if row.captures:  # what the host fed since the last step (prefill, plain steps)
                self.pending.setdefault(id(row), []).append(dict(row.captures))

    def _features(self, row: Any) -> Optional[mx.array]:
        """[1, n, taps*F]: the row's pending target features in fc's order, or None."""
        return self._joined(self.pending.pop(id(row), []))

    def _joined(self, parts: List[Dict[int, mx.array]]) -> Optional[mx.array]:
        if not parts:
            return None
        layers = self.drafter.capture_layers()
        missing = [i for i in layers if not all(i in p for p in parts)]
        if missing:
            raise RuntimeError(f"the target's forward did not capture layers {missing} (asked for {layers})")
        return mx.concatenate([mx.concatenate([p[i] for p in parts], axis=1) for i in layers], axis=-1)

    def _tokens(self, row: Any, start: int, n: int) -> List[int]:
        """The tokens paired with drafter positions start..start+n-1 (each position's next token)."""
        return row.tokens[start + 1 : start + n + 1]

    def _project(self, feats: mx.array) -> mx.array:
        """[B, n, taps*F] target features -> [B, n, H], what a drafter position reads besides its token."""
        return self.drafter.model.project(feats.astype(self.drafter.dtype))

    def _catch_up(self, caches: List[Any], tokens: List[List[int]], hidden: mx.array, counts: List[int]) -> mx.array:
        """Feed [B, W] tokens with their [B, W, H] projected features, keeping counts[b] positions of
        row b. Returns [B, 1, H]: each row's output at its last new position (rows with none: zeros)."""
        d = self.drafter
        width = hidden.shape[1]
        if d.shape_stable and width > 1:  # a catch-up feeds any count; each new count builds new kernels
            padded = 1 << (width - 1).bit_length()
            hidden = mx.pad(hidden, [(0, 0), (0, padded - width), (0, 0)])
            width = padded
        ids = mx.array([t + [0] * (width - len(t)) for t in tokens], dtype=mx.uint32)  # [B, W]
        with CacheTransaction(caches) as txn:
            h = d.model(d.embed(ids), hidden, caches)  # [B, W, H]
            txn.commit(counts, written=width)
        at = mx.array([max(c - 1, 0) for c in counts])[:, None, None]
        return mx.take_along_axis(h, at, axis=1)  # [B, 1, H]

    def prepare(self, rows: Sequence[Any]) -> None:
        d = self.drafter
        for row in self.fresh:  # a row's prompt is fed alone, then its caches merge into the batch's
            caches, start, known = self.restored.pop(id(row), None) or (d.make_cache(), 0, None)
            feats = self._features(row)
            hidden = None if feats is None else self._project(feats)  # [1, n, H]
            if known is not None:  # restored: the positions its caches do not hold yet come first
                if start:
                    self.log.append(row, known[:, :start])
                hidden = known[:, start:] if hidden is None else mx.concatenate([known[:, start:], hidden], axis=1)
            n = 0 if hidden is None else hidden.shape[1]
            last = mx.zeros((1, 1, d.args.hidden_size), d.dtype)
            if n:
                last = self._catch_up(caches, [self._tokens(row, start, n)], hidden, [n])
                self.log.append(row, hidden)
                self.prefills += 1
            self.cache = add_row(self.cache, len(self.rows), caches)
            self.last = last if self.last is None else mx.concatenate([self.last, last], axis=0)
            self.rows.append(row)
            self.context.append(start + n)
            self.ready.append(n > 0)
        self.fresh = []
        order = {id(r): b for b, r in enumerate(self.rows)}
        if [order.get(id(r)) for r in rows] != list(range(len(self.rows))):
            raise RuntimeError("EAGLE-3 rows must keep the batch's order")
        feats = [self._features(r) for r in self.rows]
        counts = [0 if f is None else f.shape[1] for f in feats]
        if max(counts, default=0) > 0:
            width = max(counts)
            F = next(f.shape[2] for f in feats if f is not None)
            dtype = next(f.dtype for f in feats if f is not None)
            padded = mx.concatenate([mx.zeros((1, width, F), dtype) if f is None else
                                     mx.pad(f, [(0, 0), (0, width - f.shape[1]), (0, 0)]) for f in feats], axis=0)
            tokens = [self._tokens(r, c, n) for r, c, n in zip(self.rows, self.context, counts)]
            hidden = self._project(padded)  # [B, width, H]
            last = self._catch_up(self.cache, tokens, hidden, counts)  # draft step 1 for every row
            self.forwards += 1
            for b, (row, n) in enumerate(zip(self.rows, counts)):
                if n:
                    self.log.append(row, hidden[b : b + 1, :n])
            fed = mx.array(counts)[:, None, None] > 0
            self.last = mx.where(fed, last, self.last)
            self.ready = [r or n > 0 for r, n in zip(self.ready, counts)]
        self.context = [c + n for c, n in zip(self.context, counts)]
        mx.async_eval(self.log.arrays())  # queued: the round goes on meanwhile
        for row, c in zip(self.rows, self.context):
            if c != len(row.tokens) - 1:
                raise RuntimeError(f"EAGLE-3 context out of step: {c} positions in the drafter's cache, but the "
                                   f"target has consumed {len(row.tokens) - 1}")

    def cache_groups(self) -> List[Any]:
        return [(self.cache, list(range(len(self.rows))))] if self.cache else []

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        d = self.drafter
        k = max([m for m, ok in zip(max_drafts, self.ready) if ok], default=0)
        if k == 0:
            return [Proposal([]) for _ in rows]
        greedy = [r.sampling.greedy for r in rows]
        h = self.last  # [B, 1, H]
        steps: List[mx.array] = []  # [B] target ids per step
        qs: List[List[mx.array]] = [[] for _ in rows]  # per row: [V] log q per step (sampling rows)
        for s in range(k):
            if s:  # one forward for every row: the previous draft, and the state that drafted it
                h = d.model(d.embed(steps[-1][:, None]), d.model.carry(h), self.cache)  # [B, 1, H]
                self.forwards += 1
            logits = d.model.logits(h[:, 0]).astype(mx.float32)  # [B, draft_vocab]
            steps.append(self._choose(rows, greedy, logits, qs))
        tokens = mx.stack(steps, axis=1)  # [B, k]
        q = [mx.stack(r) if r else None for r in qs]
        mx.async_eval(tokens, [x for x in q if x is not None])  # queued: the verify is built meanwhile
        return [Proposal(tokens[b, :m], None if q[b] is None else q[b][:m]) if m and ok else Proposal([])
                for b, (m, ok) in enumerate(zip(max_drafts, self.ready))]

    def _choose(self, rows: Sequence[Any], greedy: List[bool], logits: mx.array, qs: List[List[mx.array]]) -> mx.array:
        """[B] target ids: argmax over the draft vocabulary, or a draw from q over the target's full
        vocabulary (the draft distribution, zero outside the draft vocabulary, through the row's
        sampling filters as p is): rejection sampling then compares like with like."""
        d = self.drafter
        if all(greedy):
            return d.targets[mx.argmax(logits, axis=-1)]
        full = d.full_vocab(logits)  # [B, V], -inf outside the draft vocabulary
        out = []
        for b, row in enumerate(rows):
            if greedy[b]:
                out.append(d.targets[mx.argmax(logits[b])])
                continue
            logq = row.sampling.process(full[b] - mx.logsumexp(full[b], axis=-1, keepdims=True))  # [V]
            out.append(row.draw_drafts(logq, offset=len(qs[b])))  # qs[b]: one q per earlier step
            qs[b].append(logq)
        return mx.stack(out).astype(mx.uint32)

    # the prompt cache -----------------------------------------------------------------------------
    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        raw = self._joined(self.pending.get(id(row), []) + ([dict(row.captures)] if row.captures else []))
        return feature_log.export_row(self, row, positions, None if raw is None else self._project(raw))

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        return feature_log.restore_row(self, row, saved, n)

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        # The committed positions come back at the next prepare with the target's features.
        for row, v in zip(rows, verified):
            if v.captures:
                self.pending.setdefault(id(row), []).append(v.captures)
        return [0] * len(rows)
