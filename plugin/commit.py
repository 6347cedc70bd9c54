"""Committing a round: every cache it wrote keeps exactly the committed positions, row by row.

The target's caches (``batch.cache``) took the verify forward's W positions of every row; row b
keeps ``accepted_b + 1`` of them (its pending token and its accepted drafts; the bonus becomes the
new pending token, not yet fed) in ONE transaction with per-row lengths (``hooks.transaction``).
The drafter then learns what each row kept (``DraftBatch.commit``, with the target's outputs at
the committed positions for drafters that read them) and its own transactions keep what it says.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from ..drafters.base import DraftBatch, Verified
from ..hooks.api import CacheTransaction
from .accept import RoundOutcome
from .draft import Drafted


def fit(txn: CacheTransaction, outcomes: List[RoundOutcome], width: int) -> List[RoundOutcome]:
    """The outcomes the target's caches can keep exactly. Rows keep different lengths unless a cache
    could only take them by replaying the model over unequal rows (recurrent layers that ignore
    mlx-lm's ``lengths``); then every row emits as many tokens as the row that emits fewest: still
    lossless, each row's first tokens are its own (accepted drafts, or its bonus)."""
    emitted = [o.emitted for o in outcomes]
    if txn.exact(emitted, width):
        return outcomes
    m = min(emitted)
    return [RoundOutcome(o.draft_tokens, min(o.accepted, m - 1), o.tokens[:m]) for o in outcomes]


def commit_target(txn: CacheTransaction, outcomes: Sequence[RoundOutcome], width: int) -> None:
    """Row b keeps its pending token and its accepted drafts of the ``width`` positions fed."""
    txn.commit([o.emitted for o in outcomes], written=width)


def verified(outcomes: Sequence[RoundOutcome], captured: Dict[int, mx.array], layers: Sequence[int],
             index: Sequence[int]) -> List[Verified]:
    """What each drafting row (``index[j]``: its row in the batch) kept, with the target's outputs
    at its committed positions for ``layers``."""
    out = []
    for b in index:
        o = outcomes[b]
        caps = {i: captured[i][b : b + 1, : o.emitted] for i in layers if i in captured}  # [1, a+1, H]
        out.append(Verified(accepted=o.accepted, drafted=o.draft_tokens, captures=caps, source=(captured, b)))
    return out


def commit_drafter(drafter: DraftBatch, drafted: Drafted, rows: Sequence[Any], kept: Sequence[Verified]) -> None:
    """The drafter keeps, per row, the positions of its round's writes that it says stay."""
    keep: List[int] = drafter.commit(rows, kept)
    if len(keep) != len(rows):
        raise ValueError(f"the drafter's commit returned {len(keep)} lengths for {len(rows)} rows")
    for txn, idx in drafted.txns:
        txn.commit([keep[b] for b in idx])


class Open:
    """A round's open transactions, the drafter's (``drafted``) and, once begun, the target's: rolled back where
    the block they guard raises (``with Open(drafted) as txns``); ``fed``: the verify's inputs [B, W], for a
    cache that keeps part of a forward by replaying it."""

    def __init__(self, drafted: Drafted) -> None:
        self.drafted = drafted
        self.target: Optional[CacheTransaction] = None
        self.fed: Optional[mx.array] = None

    def __enter__(self) -> "Open":
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        if kind is not None:
            abort(self.target, self.drafted)
        return False


def abort(target: Optional[CacheTransaction], drafted: Optional[Drafted]) -> None:
    """Roll back every open transaction of the round (an exception, a drafter found unusable)."""
    if target is not None:
        target.abort()
    if drafted is not None:
        drafted.abort()
