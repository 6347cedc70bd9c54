"""The rows of one batch drafting with a DFlash drafter (``DFlashBatch``): their context caches,
the target features not yet in them, and the one drafter forward per round that drafts every
row's block.

The server's prompt cache keeps a row's context (``export_row``: its context cache and the
captured features not yet in it, trimmed to the kept tokens); a row restored from it starts with
that context trimmed to its reused prefix (``restore_row``), the host's captures of the rest
following, so the first round drafts with the full context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import mlx.core as mx

from ...hooks.api import (
    CacheTransaction, add_row, arrays, cache_bytes, copy_caches, extract_row, keep_rows, trim_caches,
)
from ..base import DraftBatch, DraftState, Proposal, Unread, Verified
from .features import target_features

CONTEXT_CHUNK = 512  # the longest context append: longer ones go in chunks (DFlashBatch._append)

if TYPE_CHECKING:
    from . import DFlashDrafter


@dataclass
class Ahead:
    """The next round's blocks, drafted before the host read this round's outcome (``draft_ahead``)."""

    rows: List[Any]  # the drafter's rows, in its cache order
    context: List[int]  # each row's context positions when queued; the W positions after them hold the round's features
    width: int  # W
    unread: Unread  # the outcomes it assumed (on the device; read by the host by the time it is used)
    tokens: List[mx.array]  # [k_b] per row: the draft tokens
    taken: bool = False  # ``prepare`` kept their context: their tokens serve the next ``propose``

    def serves(self, rows: Sequence[Any]) -> bool:
        return same_rows(rows, self.rows)

    def keep(self, present: Set[int]) -> bool:
        """Whether the blocks still serve once only the rows whose ids are ``present`` stay (no new ones): the
        rows leaving dropped from them. Down to one row they do not: its cache is then extracted to its own
        positions (``hooks.batch.keep_rows``), without the ones drafted ahead past them."""
        keep = [b for b, r in enumerate(self.rows) if id(r) in present]
        if len(keep) == len(self.rows):
            return len(present) == len(keep)
        if len(keep) < 2 or len(present) != len(keep) or self.taken:
            return False
        self.rows, self.context = [self.rows[b] for b in keep], [self.context[b] for b in keep]
        at = mx.array(keep)
        self.unread = Unread(self.unread.accepted[at], self.unread.bonus[at])
        self.tokens = [self.tokens[b] for b in keep]
        return True


class DFlashBatch(DraftBatch):
    """The rows of one batch drafting with a DFlash drafter: their context caches and the target
    features not yet in them. One drafter forward per round drafts every row's block."""

    rows_draft_together = True  # one forward a draft step for every row

    def __init__(self, drafter: "DFlashDrafter"):
        self.drafter = drafter
        self.rows: List[Any] = []  # DecodeStates in cache-row order (rows that already have a context)
        self.context: List[int] = []  # positions in each row's context cache
        self.pending: Dict[int, List[Dict[int, mx.array]]] = {}  # id(row) -> captures not yet in the cache
        # id(row) -> (the round's verify outputs, the row's index there, its count, its pending captures) for a
        # row whose pending features are exactly its committed positions of the last round (``_batched_features``)
        self.sources: Dict[int, Tuple[Dict[int, mx.array], int, int, Dict[int, mx.array]]] = {}
        self.fresh: List[Any] = []  # rows seen, their context not made yet
        self.cache: List[Any] = []  # per drafter layer: one row's own cache, or batched caches
        self.restored: Dict[int, Tuple[List[Any], int]] = {}  # id(row) -> (context caches, positions)
        self.ahead: Optional[Ahead] = None
        self.ahead_used = 0  # rounds whose block was drafted ahead
        self.context_chunk: Optional[int] = None  # the longest context append (None: CONTEXT_CHUNK)

    def sync(self, rows: Sequence[Any]) -> None:
        present = {id(r) for r in rows}
        if self.ahead is not None and (any(r.captures for r in rows) or not self.ahead.keep(present)):
            self.ahead = None  # new rows, or plain steps since: its context is stale
        keep = [b for b, r in enumerate(self.rows) if id(r) in present]
        if len(keep) < len(self.rows):
            self.cache = keep_rows(self.cache, keep, len(self.rows))
            self.rows = [self.rows[b] for b in keep]
            self.context = [self.context[b] for b in keep]
        self.fresh = [r for r in self.fresh if id(r) in present]
        known = {id(r) for r in self.rows + self.fresh}
        self.fresh += [r for r in rows if id(r) not in known]
        self.pending = {k: v for k, v in self.pending.items() if k in present}
        self.sources = {k: v for k, v in self.sources.items() if k in present}
        self.restored = {k: v for k, v in self.restored.items() if k in present}
        for row in rows:
            if row.captures:  # what the host fed since the last step (prefill, plain steps)
                self.pending.setdefault(id(row), []).append(dict(row.captures))

    def _features(self, row: Any) -> Optional[mx.array]:
        """[1, n, taps*H]: the row's pending target features, or None."""
        parts = self.pending.pop(id(row), [])
        if not parts:
            return None
        layers = self.drafter.capture_layers()
        joined = {i: mx.concatenate([p[i] for p in parts], axis=1) if len(parts) > 1 else parts[0][i]
                  for i in layers if all(i in p for p in parts)}
        return target_features(joined, layers, self.drafter.final_norm)

    def prepare(self, rows: Sequence[Any]) -> None:
        """Append each row's new context (the committed positions' features), exactly its own count."""
        d = self.drafter
        self._take_ahead()
        for row in self.fresh:  # a row's first context (its whole prompt) is made alone, then merged
            caches, start = self.restored.pop(id(row), None) or (d.make_cache(), 0)
            feats = self._features(row)
            n = 0 if feats is None else feats.shape[1]
            if n:
                self._append(caches, feats[None] if feats.ndim == 2 else feats, [n])
            self.cache = add_row(self.cache, len(self.rows), caches)
            self.rows.append(row)
            self.context.append(start + n)
        self.fresh = []
        order = {id(r): b for b, r in enumerate(self.rows)}
        if [order.get(id(r)) for r in rows] != list(range(len(self.rows))):
            raise RuntimeError("DFlash rows must keep the batch's order")
        batched = self._batched_features()
        if batched is not None:
            feats_b, counts = batched
            self._append(self.cache, feats_b, counts)
            feats = []
        else:
            feats = [self._features(r) for r in self.rows]
            counts = [0 if f is None else f.shape[1] for f in feats]
        if feats and max(counts) > 0:
            width = max(counts)
            H = next(f.shape[2] for f in feats if f is not None)
            dtype = next(f.dtype for f in feats if f is not None)
            padded = mx.concatenate([mx.concatenate([f, mx.zeros((1, width - c, H), dtype)], axis=1) if f is not None and c < width
                                     else (f if f is not None else mx.zeros((1, width, H), dtype))
                                     for f, c in zip(feats, counts)], axis=0)  # [B, width, taps*H]
            self._append(self.cache, padded, counts)
        self.context = [c + n for c, n in zip(self.context, counts)]
        for row, c in zip(self.rows, self.context):
            if c != len(row.tokens) - 1:
                raise RuntimeError(f"DFlash context out of step: {c} positions in the drafter's cache, but the "
                                   f"target has consumed {len(row.tokens) - 1}")

    def _batched_features(self) -> Optional[Tuple[mx.array, List[int]]]:
        """([B, n, taps*H], counts) where every row's pending features are its committed positions of the last
        round's verify, rows in the verify's order: taken from the round's outputs in one go, not a slice, a
        concatenation and a padding per row (a batch's host work). Past a row's count the features are the
        round's other positions, written past its context and never kept (``_append`` commits the counts)."""
        if len(self.rows) < 2:
            return None
        got = [self.sources.get(id(r)) for r in self.rows]
        for r, g in zip(self.rows, got):
            parts = self.pending.get(id(r))
            if g is None or parts is None or len(parts) != 1 or parts[0] is not g[3]:
                return None
        src = got[0][0]
        layers = self.drafter.capture_layers()
        if any(g[0] is not src for g in got) or [g[1] for g in got] != list(range(len(self.rows))) \
                or any(i not in src or src[i].shape[0] != len(self.rows) for i in layers):
            return None  # other rows in the verify too (e.g. a request decoding plainly): one slice per row
        counts = [g[2] for g in got]
        n = max(counts)
        for r in self.rows:
            del self.pending[id(r)], self.sources[id(r)]
        return target_features({i: src[i][:, :n] for i in layers}, layers, self.drafter.final_norm), counts

    def _append(self, caches: List[Any], feats: mx.array, counts: List[int]) -> None:
        """Append [B, width, F] features, keeping counts[b] positions of row b."""
        width = feats.shape[1]
        chunk = width
        if self.drafter.shape_stable and width > 1:
            padded, chunk = context_chunks(width, self.context_chunk)
            feats = mx.concatenate([feats, mx.zeros((feats.shape[0], padded - width, feats.shape[2]), feats.dtype)], axis=1)
            width = padded
        with CacheTransaction(caches) as txn:
            for start in range(0, width, chunk):
                self.drafter.append_context(caches, feats[:, start:start + chunk])  # [B, <= chunk, F]
                if start == 0 and width > chunk:
                    _reserve(caches, width - chunk)
            txn.commit(counts, written=width)

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        d = self.drafter
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.taken and ahead.serves(rows) \
                and all(m <= t.shape[0] for m, t in zip(max_drafts, ahead.tokens)):
            self.ahead_used += 1
            # the tokens themselves where all are wanted: a slice would be read behind queued work
            return [Proposal(t if m == t.shape[0] else t[:m]) if m else Proposal([]) for m, t in zip(max_drafts, ahead.tokens)]
        k = max(max_drafts)
        W = k + 1
        # Shape-stable caches (CUDA): the block too is padded to a power of two, so adaptive sizes
        # meet few attention shapes; the padding slots are masked out as keys.
        width = 1 << (W - 1).bit_length() if d.shape_stable else W
        block = mx.array([[r.pending] + [d.mask_token_id] * (width - 1) for r in rows], dtype=mx.uint32)  # [B, width]
        widths = None if width == W and min(max_drafts) == k else mx.array([m + 1 for m in max_drafts])
        greedy = [r.sampling.greedy for r in rows]
        drafted = d.draft(self.cache, block, widths) if all(greedy) else None  # [B, width - 1]: one compiled call
        if drafted is not None:
            self.forwards += 1
            if len(rows) == 1:  # its k drafts, the call's output itself where it has no padding
                tokens = drafted[0] if width == W else drafted[0, :k]  # [k]
                mx.async_eval(tokens)
                return [Proposal(tokens) if k else Proposal([])]
            mx.async_eval(drafted)
            return [Proposal(drafted[b, :m]) if m else Proposal([]) for b, m in enumerate(max_drafts)]
        h = d.block(self.cache, block, widths)  # [B, width, H]
        self.forwards += 1
        logits = d.head(h[:, 1:W]).astype(mx.float32)  # [B, k, V]
        if all(greedy):
            # Greedy rounds compare tokens only: no q to hand back.
            tokens, qs = mx.argmax(logits, axis=-1), [None] * len(rows)  # [B, k]
        else:
            drawn, qs = [], []
            for b, row in enumerate(rows):
                if greedy[b]:
                    drawn.append(mx.argmax(logits[b], axis=-1))
                    qs.append(None)
                    continue
                # Drafts must be drawn from the q handed back, or rejection sampling is not lossless;
                # q goes through the request's sampling filters as the target's p does.
                logq = row.sampling.process(logits[b] - mx.logsumexp(logits[b], axis=-1, keepdims=True))  # [k, V]
                drawn.append(row.draw_drafts(logq))  # [k]: the block's positions 0..k-1
                qs.append(logq)
            tokens = mx.stack(drawn)  # [B, k]
        # Queued, not awaited: the round builds its verify forward while the GPU drafts.
        mx.async_eval(tokens, [q for q in qs if q is not None])
        return [Proposal(tokens[b, :m], None if qs[b] is None else qs[b][:m]) if m else Proposal([])
                for b, m in enumerate(max_drafts)]

    def drafts_ahead(self, rows: Sequence[Any]) -> bool:
        calls = self.drafter.compiler
        return calls is not None and (len(rows) == 1 or calls.batches) and all(r.sampling.greedy for r in rows)

    def draft_ahead(self, rows: Sequence[Any], unread: Unread, max_drafts: Sequence[int]) -> None:
        """Greedy rows over the backend's compiled calls: the round's W verified positions appended to each row's
        context past its committed ones (the host's lengths unchanged), then the next blocks at the device's
        offsets context_b + a_b + 1, each one's first token its bonus. ``prepare`` keeps the a_b + 1 positions the
        host committed, ``propose`` serves the tokens where the rows and the outcomes are as assumed. Every row of
        the drafter's batch, in its order, must have an outcome (one call drafts them all)."""
        self.ahead = None
        d = self.drafter
        if not self.drafts_ahead(rows) or not rows or self.fresh or not same_rows(rows, self.rows) \
                or max(max_drafts) < 1:
            return
        # A row that drafted nothing this round (paused, at its end) gets a block too: a row that rides or
        # probes next round finds it ready, one that does not takes none of it (``propose``).
        max_drafts = [m or max(max_drafts) for m in max_drafts]
        if not unread.captures or any(self.pending.get(id(r)) for r in rows):
            return
        layers = d.capture_layers()
        one = len(rows) == 1
        feats = target_features(unread.captures, layers, d.final_norm)  # [B, W, taps*H]
        k = max(max_drafts)
        width = 1 << k.bit_length()  # k + 1 positions, padded to a power of two as ``propose`` pads them
        mask = mx.full((len(rows), width - 1), d.mask_token_id, dtype=mx.uint32)
        block = mx.concatenate([unread.bonus.reshape(-1, 1).astype(mx.uint32), mask], axis=1)  # [B, width]
        widths = None if width == k + 1 and min(max_drafts) == k else mx.array([m + 1 for m in max_drafts])
        # one row: a scalar shift (its traces as before); a batch: [B], each row's
        shift = unread.accepted[0] + 1 if one else unread.accepted + 1
        drafted = d.draft(self.cache, block, widths, feats, shift)  # [B, width - 1]
        if drafted is None:
            return
        self.forwards += 1
        tokens = [drafted[0] if width == k + 1 else drafted[0, :k]] if one else [drafted[b, :m] for b, m in enumerate(max_drafts)]
        mx.async_eval(tokens)
        self.ahead = Ahead(list(rows), list(self.context), feats.shape[1], unread, tokens)

    def ahead_drafts(self, rows: Sequence[Any], unread: Unread) -> Optional[List[mx.array]]:
        ahead = self.ahead
        if ahead is None or ahead.taken or len(rows) != 1 or not ahead.serves(rows):
            return None
        return ahead.tokens

    def _take_ahead(self) -> None:
        """The positions the host committed out of those ``draft_ahead`` appended, kept: each row's pending
        features are then exactly those (its captures at the round's a_b + 1 committed positions)."""
        ahead = self.ahead
        if ahead is not None and ahead.taken:
            return  # taken by an earlier prepare of this step
        if ahead is None or self.fresh or not ahead.serves(self.rows) or self.context != ahead.context:
            self.ahead = None
            return
        counts = []
        accepted, bonus = ahead.unread.accepted.tolist(), ahead.unread.bonus.tolist()  # read by the host already
        for row, a, x in zip(ahead.rows, accepted, bonus):
            parts = self.pending.get(id(row), [])
            n = next(iter(parts[0].values())).shape[1] if len(parts) == 1 and parts[0] else 0
            if not 0 < n <= ahead.width or a + 1 != n or x != row.pending:
                self.ahead = None  # not the outcome it assumed: draft as usual
                return
            counts.append(n)
        for row in ahead.rows:
            del self.pending[id(row)]
            self.sources.pop(id(row), None)
        self.context = [c + n for c, n in zip(ahead.context, counts)]
        for c in self.cache:
            if len(self.rows) == 1:
                c.offset = self.context[0]
            else:
                c.set_lengths(self.context)  # RaggedBatchKVCache: the compiled calls' batched caches
        ahead.taken = True

    # the prompt cache -----------------------------------------------------------------------------
    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        """(context caches, positions in them, {layer: [1, p, H]} captures after them or None)."""
        b = next((i for i, r in enumerate(self.rows) if r is row), None)
        if b is not None:
            caches, c = (extract_row(self.cache, b) if len(self.rows) > 1 else self.cache), self.context[b]
        elif id(row) in self.restored:
            caches, c = self.restored[id(row)]
        elif row.cached == 0:
            caches, c = self.drafter.make_cache(), 0
        else:
            return None  # the captures it has start after positions it holds no context for
        layers = self.drafter.capture_layers()
        parts = self.pending.get(id(row), []) + ([dict(row.captures)] if row.captures else [])
        tail = {i: mx.concatenate([p[i] for p in parts], axis=1) for i in layers} if parts else None
        caches = copy_caches(caches)
        if c >= positions:
            trim_caches(caches, c - positions)
            c, tail = positions, None
        elif tail is not None:
            tail = {i: h[:, : positions - c] for i, h in tail.items()}
        held = c + (tail[layers[0]].shape[1] if tail else 0)
        mx.eval(arrays(caches), list((tail or {}).values()))
        nbytes = cache_bytes(caches) + sum(h.nbytes for h in (tail or {}).values())
        return DraftState(held, (caches, c, tail), nbytes) if held > 0 else None

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        caches, c, tail = saved.value
        if saved.positions < n:
            raise RuntimeError(f"DFlash state covers {saved.positions} positions; the row reuses {n}")
        caches = copy_caches(caches)
        if c >= n:
            trim_caches(caches, c - n)
            c, tail = n, None
        self.restored[id(row)] = (caches, c)
        if tail is not None:  # captures of positions c..n, before what the host hands over
            self.pending.setdefault(id(row), []).insert(0, {i: h[:, : n - c] for i, h in tail.items()})
        return True

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        # The committed positions' features become context at the next prepare; the block wrote nothing.
        for row, v in zip(rows, verified):
            self.sources.pop(id(row), None)
            if v.captures:
                self.pending.setdefault(id(row), []).append(v.captures)
                if v.source is not None:
                    n = next(iter(v.captures.values())).shape[1]
                    self.sources[id(row)] = (v.source[0], v.source[1], n, v.captures)
        return [0] * len(rows)


def same_rows(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """The same row objects in the same order."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def context_chunks(n: int, chunk: Optional[int] = None) -> Tuple[int, int]:
    """(padded width, chunk) for appending ``n`` > 1 positions on shape-stable caches. A prompt or a
    catch-up after plain steps feeds any count, and each new count builds new kernels on CUDA: chunks of
    ``chunk`` (a power of two; default CONTEXT_CHUNK) and a power-of-two tail, the counts prewarm() made at load."""
    chunk = CONTEXT_CHUNK if chunk is None else chunk
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"DFlash context chunk: got {chunk}; expected a power of two")
    tail = n % chunk if n > chunk else n
    padded = n - tail + (1 << (tail - 1).bit_length() if tail else 0)
    return padded, min(padded, chunk)


def _reserve(caches: List[Any], n: int) -> None:
    """Each cache's buffer grown once for ``n`` more positions (zeros written, trimmed off again), so
    that the chunks after the first write into it in place: grown chunk by chunk, a 16k-position first
    context cost ~1.5x as much on the H200 (bench/results/kernels/h200-context-build-reserved.json)."""
    for c in caches:
        keys = getattr(c, "keys", None)
        if keys is None:
            continue
        B, H, _, D = keys.shape  # [B, H, buffer, D]
        Dv = c.values.shape[3]
        c.update_and_fetch(mx.zeros((B, H, n, D), keys.dtype), mx.zeros((B, H, n, Dv), c.values.dtype))
        c.trim(n)
