"""Drafting ahead: the round's optional pipelined proposer.

Before the host reads a round's outcome (``accept.RoundPlans.read``), the drafter may queue its next block from
the outcome still on the device (``DraftBatch.draft_ahead``) and, opt-in, the next round's verify forward
over that block (verify_ahead.py). The next round takes them up only where everything is as they assumed;
anything else is dropped unread, so drafting ahead costs host time, never a token.

A failure here does not stop the round: the target's tokens are committed first, then the round raises it
where the drafter commits (``DraftAhead.check``), and the rows fall back to plain decoding.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafters.base import DraftBatch, Proposal, Unread
from ..hooks.api import DecodeBatch, DecodeState
from .accept import RoundPlans
from .metrics import Laps
from .cuda.verify_ahead import Queued, queue, settle


class DraftAhead:
    """What one round queues before the host reads its outcome. ``on``: the drafter drafts the next block of
    its drafting ``rows`` ahead (rounds of lazy drafts only); ``plans``: the round's acceptance (accept.py)."""

    def __init__(self, att: Any, drafter: DraftBatch, rows: Sequence[DecodeState], lazy: bool, plans: RoundPlans) -> None:
        self.drafter, self.verify_ahead = drafter, att.verify_ahead
        self.on = att.ahead and lazy and drafter.drafts_ahead(rows)
        # The rows' (accepted a [B], bonus [B]) still on the device (a row that drafted nothing: 0, its token).
        self.unread: Optional[Tuple[mx.array, mx.array]] = plans.unread() if self.on else None
        self.error: Optional[BaseException] = None  # raised by ``check``, after the target's commit
        self.queued: Optional[Queued] = None  # the next round's verify (verify_ahead.py)

    @property
    def arrays(self) -> List[mx.array]:
        """The unread outcomes to evaluate with the round's plans."""
        return list(self.unread) if self.unread is not None else []

    def queue_next(self, lap: Laps, batch: DecodeBatch, rows: Sequence[DecodeState], on: Sequence[int],
                   reqs: Sequence[Any], proposals: Sequence[Proposal], captured: Dict[int, mx.array], written: int,
                   vocab_size: int, width_for: Callable[[int], int]) -> None:
        """The drafter's next block (lap ``draft_ahead``) and, where the next round is likely alike, its verify
        (lap ``queue``), queued from the unread outcome; a failure is kept for ``check``."""
        if not self.on:
            return
        with lap.phase("draft_ahead"):
            self.error = draft_ahead(self.drafter, rows, on, [len(proposals[b].tokens) for b in on], self.unread, captured)
        if self.error is None and self.verify_ahead and next_round_alike(rows, on, reqs, proposals):
            with lap.phase("queue"):
                try:
                    a, bonus = self.unread
                    self.queued = queue(batch, self.drafter, (a[0], bonus[0]), written, vocab_size, width_for)
                except Exception as e:  # noqa: BLE001 - like a failing ahead: falls back after the commit
                    self.error = e

    def check(self) -> None:
        """Raise the failure of drafting ahead (the round calls it after the target's commit)."""
        if self.error is not None:
            raise self.error

    def where(self, error: BaseException) -> str:
        """What the drafter was doing when the round's drafter commit failed with ``error``."""
        return "drafting ahead" if error is self.error else "committing"

    def settle(self, batch_rounds: Any, req: Any, lap: Laps) -> None:
        """The verify queued ahead handed to the next round (``batch_rounds.queued``: ``round.BatchRounds``),
        where the round's one row drafts on (lap ``settle``, recorded into its stats)."""
        if self.queued is not None and self.error is None and req.failed is None:
            with lap.phase("settle"):
                batch_rounds.queued = settle(self.queued, req.expected)
            req.stats.record_steps(lap, "settle")


def next_round_alike(rows: Sequence[DecodeState], on: Sequence[int], reqs: Sequence[Any],
                     proposals: Sequence[Proposal]) -> bool:
    """Whether the next round of this one-row batch will want no more drafts than this one, whatever this
    round accepts (so that a verify queued over as many is likely to serve it): a pinned block or one at its
    cap (the controller only grows below it), and tokens left for a round after this one's."""
    if len(rows) != 1 or list(on) != [0]:
        return False
    c, k = reqs[0].controller, len(proposals[0].tokens)
    return (not c.adaptive or c.size >= c.cap) and rows[0].remaining - (k + 1) >= 2


def draft_ahead(drafter: DraftBatch, rows: Sequence[DecodeState], on: Sequence[int], max_drafts: Sequence[int],
                unread: Tuple[mx.array, mx.array], captured: Dict[int, mx.array]) -> Optional[BaseException]:
    """The drafter's next block queued from this round's unread outcome ((a [B], bonus [B]) over the batch's rows;
    ``DraftBatch.draft_ahead``), for the drafting rows ``on``: the batch's arrays whole where every row drafts;
    an exception is returned, for the round to fall back after committing the target's tokens."""
    a, bonus = unread
    if list(on) == list(range(len(rows))):
        outcome = Unread(a, bonus, dict(captured))
    else:
        at = mx.array(list(on))
        outcome = Unread(a[at], bonus[at], {i: h[at] for i, h in captured.items()})
    try:
        drafter.draft_ahead([rows[b] for b in on], outcome, max_drafts)
    except Exception as e:  # noqa: BLE001 - any drafter failure falls back, never loses tokens
        return e
    return None
