"""``draft_model``: any mlx-lm causal LM with the target's tokenizer as drafter (mlx-lm's --draft-model).

The rows of a batch draft together: one forward of the draft model per draft step for every row,
on batched caches (the draft model's own mlx-lm caches, merged as the host merges the target's).
Per round: ``prepare`` feeds each row the tokens committed since it last drafted (a row new to the
batch first prefills its own cache alone, then joins), keeping exactly each row's own count;
``propose`` runs the draft steps; ``commit`` keeps each row's accepted drafts.

The server's prompt cache keeps a row's draft caches (``export_row``: the positions they hold); a
row restored from it (``restore_row``) starts from them trimmed to its reused prefix and prefills
only the rest. Caches that cannot be trimmed (a recurrent draft model) restore only at exactly
their length; otherwise the row prefills its whole history, as without a cache.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchRotatingKVCache, CacheList, make_prompt_cache

from ...hooks.api import (
    CacheTransaction, DraftBackend, add_row, arrays, cache_bytes, check_supported, copy_caches, extract_row, forward,
    keep_rows, mergeable, replay, scope_model, trim_caches, trimmable,
)
from ..base import (Compatibility, DraftBatch, Drafter, DrafterError, DrafterFamily, DraftState, DraftTarget, Proposal,
                    Verified)
from ..compat import check_tokenizer, check_vocab

DEFAULT_BLOCK_SIZE = 4  # 3 draft tokens, mlx-lm's default --num-draft-tokens
PREFILL_STEP = 2048


class DraftModelBatch(DraftBatch):
    """The draft model's caches for the rows of one batch, and how far each row has fed them."""

    rows_draft_together = True  # one forward a draft step for every row

    def __init__(self, drafter: "DraftModelDrafter"):
        self.model = drafter.model
        self.make_cache = drafter.make_cache
        self.rows: List[Any] = []  # DecodeStates, in the order of the cache rows
        self.fed: List[int] = []  # row b's tokens[:fed[b]] are in its cache rows
        self.cache: List[Any] = []  # per layer: one row's own caches, or batched caches
        self.first: Optional[mx.array] = None  # [B, V] logits after each row's pending token
        self.written = 0  # draft steps fed by the last propose
        self.fed_drafts: Optional[mx.array] = None  # [B, written]: the drafts they fed
        self.restored: Dict[int, Tuple[List[Any], int]] = {}  # id(row) -> (caches, positions) from the prompt cache

    # rows ---------------------------------------------------------------------------------------
    def sync(self, rows: Sequence[Any]) -> None:
        present = {id(r) for r in rows}
        keep = [b for b, r in enumerate(self.rows) if id(r) in present]
        if len(keep) < len(self.rows):
            self._keep(keep)
        known = {id(r) for r in self.rows}
        for row in rows:
            if id(row) not in known:
                self._join(row)
        self.restored = {k: v for k, v in self.restored.items() if k in present}
        order = {id(r): b for b, r in enumerate(self.rows)}
        if [order[id(r)] for r in rows] != list(range(len(rows))):
            raise RuntimeError("draft rows must keep the batch's order")

    def _keep(self, keep: List[int]) -> None:
        """Only these cache rows stay (rows that left the batch go); one row gets its own caches back."""
        self.cache = keep_rows(self.cache, keep, len(self.rows))
        self.rows = [self.rows[b] for b in keep]
        self.fed = [self.fed[b] for b in keep]

    def _join(self, row: Any) -> None:
        """A new row: prefill its own cache with everything but its pending token (after what was
        restored for it), then merge."""
        caches, done = self.restored.pop(id(row), None) or (self.make_cache(), 0)
        history = row.tokens[:-1]
        for start in range(done, len(history), PREFILL_STEP):
            forward(self.model, [history[start : start + PREFILL_STEP]], caches, [])
            mx.eval([c.state for c in caches])
        self.cache = add_row(self.cache, len(self.rows), caches)
        self.rows.append(row)
        self.fed.append(len(history))

    # a round --------------------------------------------------------------------------------------
    def prepare(self, rows: Sequence[Any]) -> None:
        """Feed each row what it committed since it last drafted (its pending token last); keep
        exactly that many positions per row. Leaves the logits after each pending token."""
        fresh = [r.tokens[f:] for r, f in zip(self.rows, self.fed)]
        width = max(len(t) for t in fresh)
        inputs = mx.array([t + [t[-1]] * (width - len(t)) for t in fresh], dtype=mx.uint32)  # [B, width]
        lengths = [len(t) for t in fresh]
        with CacheTransaction(self.cache, replay=lambda n: replay(self.model, self.cache, inputs, n)) as txn:
            logits, _ = forward(self.model, inputs, self.cache, [])
            txn.commit(lengths, written=width)
        self.forwards += 1
        self.first = logits[mx.arange(len(fresh)), mx.array(lengths) - 1]  # [B, V]
        self.fed = [f + n for f, n in zip(self.fed, lengths)]

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        assert self.first is not None, "propose() after prepare()"
        k = max(max_drafts)
        logits, self.first = self.first, None
        greedy = all(r.sampling.greedy and not r.logits_processors for r in rows)
        drafts: List[mx.array] = []  # [B] per step; all but the last are fed to the draft model
        qs: List[List[mx.array]] = [[] for _ in rows]  # per row: [1, V] per step
        history: List[List[int]] = [[] for _ in rows]  # drafts as ints, where logits processors read them
        self.written = 0
        for j in range(k):
            if greedy:
                token = mx.argmax(logits, axis=-1)  # [B]
            else:
                token = mx.concatenate([self._draw(r, logits[b : b + 1], history[b], j, qs[b])
                                        for b, r in enumerate(rows)])  # [B]
            drafts.append(token)
            if any(r.logits_processors for r in rows):
                for b, t in enumerate(token.tolist()):
                    history[b].append(int(t))
            if j == k - 1:
                break
            logits = forward(self.model, token[:, None].astype(mx.uint32), self.cache, [])[0][:, -1, :]  # [B, V]
            self.forwards += 1
            self.written += 1
        tokens = mx.stack(drafts, axis=1)  # [B, k]
        self.fed_drafts = tokens[:, : self.written]  # what the draft transaction replays, if it must
        q = [mx.concatenate(x, axis=0) if x else None for x in qs]  # [k, V] per sampled row
        mx.eval(tokens, [x for x in q if x is not None])
        out = []
        for b, m in enumerate(max_drafts):
            out.append(Proposal(tokens[b, :m].tolist(), q[b][:m] if q[b] is not None else None) if m else Proposal([]))
        return out

    def _draw(self, row: Any, logits: mx.array, history: List[int], j: int, qs: List[mx.array]) -> mx.array:
        """Row's draft j: q after the target's processing (logits processors on the same history,
        the sampler's filters and temperature), drawn by ``DecodeState.draw_drafts`` at block position j."""
        if row.sampling.greedy:
            return mx.argmax(row.logprobs(logits, history, start=j), axis=-1)  # [1]
        logq = row.sampling.process(row.logprobs(logits, history, start=j))  # [1, V]
        qs.append(logq)
        return row.draw_drafts(logq, offset=j)  # [1]

    def cache_groups(self) -> List[Tuple[List[Any], List[int]]]:
        return [(self.cache, list(range(len(self.rows))))]

    # the prompt cache -----------------------------------------------------------------------------
    def export_row(self, row: Any, positions: int) -> Optional[DraftState]:
        b = next((i for i, r in enumerate(self.rows) if r is row), None)
        if b is not None:
            caches, held = (extract_row(self.cache, b) if len(self.rows) > 1 else self.cache), self.fed[b]
        elif id(row) in self.restored:
            caches, held = self.restored[id(row)]
        else:
            return None
        caches = copy_caches(caches)
        if held > positions:
            if not trimmable(caches):
                return None
            trim_caches(caches, held - positions)
            held = positions
        mx.eval(arrays(caches))
        return DraftState(held, caches, cache_bytes(caches)) if held > 0 else None

    def restore_row(self, row: Any, saved: DraftState, n: int) -> bool:
        caches, held = copy_caches(saved.value), saved.positions
        if held > n:
            if not trimmable(caches):
                return False  # a recurrent draft model: prefill the row's history instead
            trim_caches(caches, held - n)
            held = n
        self.restored[id(row)] = (caches, held)
        return True

    def replay_group(self, group: int, n: Any) -> None:
        """Feed the first n drafts of this round again (the transaction restored the caches first):
        how a recurrent draft model whose forward could not be recorded keeps part of a round."""
        replay(self.model, self.cache, self.fed_drafts.astype(mx.uint32), n)

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        # The cache holds drafts[:written] of every row; a row keeps those it had accepted.
        kept = [min(v.accepted, self.written) for v in verified]
        if len(kept) > 1 and _has_rotating_or_recurrent(self.cache):
            # A sliding window cannot keep unequal parts of one-token updates per row (mlx-lm's
            # right-padding path is multi-token only), and a recurrent layer that cannot be recorded
            # could only replay unequal rows through lengths it may ignore: every row keeps the
            # fewest; the others feed their remaining accepted drafts again at the next prepare.
            kept = [min(kept)] * len(kept)
        self.fed = [f + n for f, n in zip(self.fed, kept)]
        return kept


def _has_rotating_or_recurrent(caches: Sequence[Any]) -> bool:
    return any(isinstance(c, (BatchRotatingKVCache, ArraysCache))
               or (isinstance(c, CacheList) and _has_rotating_or_recurrent(c.caches)) for c in caches)


class DraftModelDrafter(Drafter):
    kind = "draft_model"
    family = "draft_model"
    default_block_size = DEFAULT_BLOCK_SIZE
    max_block_size = 16

    def __init__(self, model: nn.Module, backend: Optional[DraftBackend] = None):
        self.model = model
        self.backend = backend or DraftBackend()  # the target's (shape-stable caches on CUDA), else mlx-lm's caches

    def make_cache(self) -> List[Any]:
        return self.backend.make_cache(self.model)

    def new_batch(self) -> DraftBatch:
        return DraftModelBatch(self)


def detect(config: Dict[str, Any]) -> bool:
    """Any checkpoint mlx-lm can build is usable as a draft LM (lowest priority)."""
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
        return True
    except (ValueError, KeyError):
        return False


def check(path: Optional[Path], config: Dict[str, Any], target: DraftTarget) -> Compatibility:
    verdict = Compatibility()
    check_vocab(target.config, config, verdict)
    check_tokenizer(target.path, path, verdict)
    return verdict


def load(path: Optional[Path], config: Dict[str, Any], target: DraftTarget, options: Dict[str, Any]) -> Drafter:
    from mlx_lm import load as mlx_load

    model, _ = mlx_load(str(path))
    caches = make_prompt_cache(model)
    check_supported(caches)
    if not mergeable(caches):
        raise DrafterError(f"draft model {str(path)!r}: its caches ({sorted({type(c).__name__ for c in caches})}) "
                           "cannot merge into a batch; expected mlx-lm caches with merge()")
    scope_model(model)  # recurrent draft models keep part of a round without a replay
    target.backend.route(model)  # the backend's attention and projection dispatchers (CUDA), if any
    return DraftModelDrafter(model, target.backend)


family = DrafterFamily(
    name="draft_model",
    kind="draft_model",
    description="a small causal LM with the target's tokenizer proposes tokens one at a time",
    load=load,
    check=check,
    detect=detect,
    trainer=lambda: importlib.import_module(".train", __name__).DraftModelTrainer,  # mlx-spec train-drafter
    priority=-100,
)
