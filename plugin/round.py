"""One speculative round over a batch: draft (draft.py) -> verify (verify.py) -> accept (accept.py) -> commit (commit.py).

``step`` decides which rows draft (their controllers, the batch's costs) and ``_round`` runs the round top to
bottom, each step a ``with`` block timed under its ``metrics.ROUND_STEPS`` name (``Laps.phase``) and guarded
by ``Fallback``. Before the host reads the outcome, a round may queue the next one's block
(``DraftBatch.draft_ahead``) and its verify (verify_ahead.py) from the outcome still on the device:
draft_ahead.py; the next round takes them up only where everything is as they assumed.

Every row of the batch takes part: rows with drafts get their accepted drafts plus the bonus, rows
without (speculation off for the request, fallen back, paused by the adaptive controller, nothing
left to draft) take their one token from the same verify forward. When no row drafts, the plugin
declines the step and the host takes plain steps, as many as every row's controller allows.

Nothing is lost: a drafter that raises, or proposes tokens outside the vocabulary, leaves every
cache as it was before the round, and its rows go on with plain decoding.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..drafters.base import DraftBatch, Proposal
from ..hooks.api import (WARMUP_CONTINUATION, CacheTransaction, DecodeBatch, DecodeState, GeneratedToken, StepOutput,
                         UnsupportedCache, replay)
from . import commit
from .accept import RoundOutcome, RoundPlans
from .adaptive import BlockSizeController
from .costs import batch_loses, expected_tokens, prices_plain
from .draft import DraftError, as_ints, draft
from .draft_ahead import DraftAhead
from .metrics import METRICS, Laps, SpecStats
from .settings import SpeculativeSettings
from .verify import verify
from .cuda.verify_ahead import Queued, adopt

log = logging.getLogger("mlx_speculative")
NAME = "speculative"


@dataclass
class RowRounds:
    """A request's speculative state: its block-size controller and stats (``state.extras[NAME]``)."""

    controller: BlockSizeController
    stats: SpecStats
    settings: SpeculativeSettings
    failed: Optional[str] = None
    expected: int = 0  # the request's generated count after the plugin's last answer
    to_end: bool = False  # plain steps to the end of the request (a probe could not pay for itself)
    restore: Any = None  # the drafter's DraftState from the prompt cache, until the row's first sync
    synced: bool = False  # the row drafts in its batch's DraftBatch (it has been synced there)

    def observe(self, state: DecodeState) -> int:
        """Plain steps the host took for the request since the plugin's last answer (counted)."""
        taken = state.generated - self.expected
        if taken > 0:
            (self.controller.plain_to_end if self.to_end else self.controller.take_plain_steps)(taken)
            self.stats.plain_steps += taken
            self.expected = state.generated
        return taken

    def fall_back(self, where: str, error: BaseException) -> None:
        if self.failed is None:
            self.failed = f"drafter failed while {where}: {type(error).__name__}: {error}"
            self.stats.fallback = self.failed
            METRICS.record_fallback()
            log.warning("speculative decoding: %s; continuing with plain decoding", self.failed)


@dataclass
class Answered:
    """The plugin's last answer on a batch, priced when the batch comes back (``_price``): a round of ``rows`` x
    ``width`` or plain steps of ``rows`` (width 1), asked at ``started``."""

    kind: str
    rows: int
    width: int
    started: float
    plain_runs: int  # the host's plain runs on the batch then
    version: int  # the batch's then (rows joined since: the interval paid for their prefill)


@dataclass
class BatchRounds:
    """The plugin's state for one batch (``batch.extras[NAME]``): the drafter's rows."""

    draft: DraftBatch
    queued: Optional[Queued] = None  # the next round's verify, queued by the last round (verify_ahead.py)
    answered: Optional[Answered] = None
    extras: dict = field(default_factory=dict)


def row_rounds(state: DecodeState, att: Any) -> Optional[RowRounds]:
    """The request's rounds, made when the plugin first sees it; None: it decodes plainly."""
    req = state.extras.get(NAME)
    if req is None:
        if att.drafter is None or state.options.get("speculative") is False:
            state.extras[NAME] = False
            return None
        stats = SpecStats(kind=att.drafter.kind)
        width_for = state.target.cache_policy.verify_width
        req = RowRounds(
            controller=BlockSizeController(cap=att.max_block or att.block_size, start=att.block_size,
                                           adaptive=att.settings.adaptive and att.settings.block_size is None,
                                           costs=att.costs, width_for=width_for,
                                           shape_stable=state.target.cache_policy.shape_stable,
                                           shared=None if state.options.get(WARMUP_CONTINUATION) else att.recent),
            stats=stats, settings=att.settings, expected=state.generated,
        )
        saved = state.restored.get(NAME) if state.cached else None
        req.restore = saved.value if saved is not None else None
        state.extras[NAME] = req
    return req if req and req.failed is None else None


def _observe(rows: Sequence[DecodeState], reqs: Sequence[RowRounds]) -> None:
    """Count the plain steps the host took for each row since the plugin last answered."""
    for row, req in zip(rows, reqs):
        req.observe(row)


def _price(batch: DecodeBatch, br: BatchRounds, costs: Any, now: float) -> None:
    """The plugin's last answer on ``batch`` priced by the wall clock from the host's asking to its asking again:
    a round, or the plain steps of the one run the host took (per step), with everything the generation thread did
    between (emitting the tokens, the device's work queued ahead). Rounds and plain steps are so timed alike:
    a round timed from drafting to its commit alone, and plain steps by the host's run, once priced an H100's 8-row
    round below its 8-row plain step (13.2 against 17.9 ms, served steps 24 against 11.5 ms), and rounds whose
    drafts were never accepted never paused. Skipped where rows joined since (the interval paid their prefill)."""
    a, br.answered = br.answered, None
    if a is None or batch.version != a.version:
        return
    if a.kind == "round" and batch.plain.runs == a.plain_runs:
        costs.observe("round", a.rows, a.width, now - a.started)
    elif a.kind == "plain" and batch.plain.runs == a.plain_runs + 1 and batch.plain.rows == a.rows and batch.plain.steps:
        costs.observe("plain", a.rows, 1, (now - a.started) / batch.plain.steps)


PROBE_EVERY = 8  # plain steps between asks while paused, where the drafter can tell a probe is worth it
# A plain run taken to price a row count's plain step (``prices_plain``): a run's first step is not pipelined and
# carries the plugin's asking, so one-step runs priced an H100's 8-row plain step at 18.5 ms against 14.6 in the
# runs of paused rows (15.2 served plainly), and 8-row rounds of drafts never accepted looked as cheap.
PRICE_STEPS = 8


def _plan(row: DecodeState, req: RowRounds, draft: DraftBatch) -> Optional[int]:
    """Draft tokens the row proposes this step (>= 1), or None: it takes plain steps (``_grant``)."""
    c = req.controller
    if c.paused_left and not req.to_end and draft.worth_probing(row):
        c.end_pause()
    if req.to_end or c.paused_left:
        return None
    if c.skip_probe(row.remaining):
        req.to_end = True
        return None
    if row.remaining <= 1:
        return None
    if row.target.cache_policy.shape_stable:
        # Near the end of a request the block keeps its size: a smaller one is a shape the device meets for the
        # first time (seconds of compiling on MLX-CUDA, measured on an H100: bench/results/served/h100-batch-trace.json);
        # the tokens past the request's end are dropped by the host, as after a stop token.
        return c.size - 1
    return min(c.size - 1, row.remaining - 1)


RIDE_TOKENS = 1.5  # a paused row's expected tokens a round (bonus included) from which it drafts in others' rounds


def _ride(row: DecodeState, req: RowRounds, free: int) -> Optional[int]:
    """Draft tokens a paused row proposes in a round its batch runs anyway (None: it takes its one token).

    On shape-stable targets the verify forward is [rows, widest block] whatever each row drafts, so a paused row
    drafting in it costs only its drafter's share, and its acceptance is measured afresh. Rows pausing on their
    own would otherwise each pay a whole batch's round for their probe and keep each other back: two served
    clients at tau 6 on an H100 ran 99 rounds against 2468 paused steps, 0.90x plain batching. A row unlikely to
    accept drafts probes early in such a round once half its pause is over, where its drafts cost the drafter
    nothing (``free``: the most drafts another row proposes, where one forward drafts every row,
    ``DraftBatch.rows_draft_together``; else 0): its next pause starts with the round's, so the batch's paused rows
    come to probe together, not each in a round of its own (at tau 1 each probe of 8 served rows is an 8-row round)."""
    c = req.controller
    if req.to_end or not c.paused_left or row.remaining <= 1 or not c.adaptive:
        return None
    if expected_tokens(c.alpha, c.size - 1) >= RIDE_TOKENS:
        return c.size - 1
    if free and 2 * c.paused_left <= c.pause:
        return min(c.size - 1, free)
    return None  # drafts it would not accept: not before its probe's time, nor where they cost drafter work


def _grant(row: DecodeState, req: RowRounds, probes: bool) -> Optional[int]:
    """Plain steps the host may take for a row that does not draft (None: any number); ``probes``: the drafter
    tells when a probe is worth it (``DraftBatch.worth_probing``), so it is asked again every few steps."""
    if req.to_end:
        return None
    steps = req.controller.paused_left or 1
    return min(steps, PROBE_EVERY) if probes else steps


def step(batch: DecodeBatch, att: Any) -> Optional[List[StepOutput]]:
    """The plugin's decode step for ``batch``: a round for every row, or a decline (None / plain steps)."""
    rows = list(batch.rows)
    reqs = [row_rounds(r, att) for r in rows]
    on = [b for b, req in enumerate(reqs) if req is not None]
    if not on:
        return None
    br: Optional[BatchRounds] = batch.extras.get(NAME)
    if br is None:
        br = batch.extras[NAME] = BatchRounds(att.drafter.new_batch())
    asked = time.perf_counter()
    _price(batch, br, att.costs, asked)
    _restore(br, [rows[b] for b in on], [reqs[b] for b in on])
    on = [b for b in on if reqs[b].failed is None]
    if not on:
        return None
    on_rows, on_reqs = [rows[b] for b in on], [reqs[b] for b in on]
    _observe(on_rows, on_reqs)
    try:
        br.draft.sync(on_rows)
    except Exception as e:  # noqa: BLE001 - any drafter failure falls back, never loses tokens
        return _fall_back(on_reqs, "syncing its rows", e)
    for req in on_reqs:
        req.synced = True
    plans = own = [_plan(r, q, br.draft) for r, q in zip(on_rows, on_reqs)]
    if any(plans) and batch.target.cache_policy.shape_stable:
        free = max(k or 0 for k in plans) if br.draft.rows_draft_together else 0
        plans = [k if k else _ride(r, q, free) for r, q, k in zip(on_rows, on_reqs, plans)]
    controllers = [q.controller for q in on_reqs]
    pricing = any(plans) and prices_plain(batch, att.costs, controllers)
    if pricing:
        plans = [None] * len(plans)  # plain steps of the batch's row count, priced (costs.py)
    loses = batch_loses(batch, att.costs, controllers, plans) if any(plans) else ""
    if loses:
        for req, k in zip(on_reqs, own):
            if k:  # riders are paused already: their pauses go on
                req.controller.pause_now(loses)
        plans = [None] * len(plans)
    if not any(plans):
        outs = [StepOutput([], None) for _ in rows]
        probes = type(br.draft).worth_probing is not DraftBatch.worth_probing
        for b, row, req in zip(on, on_rows, on_reqs):
            outs[b].plain_steps = PRICE_STEPS if pricing else _grant(row, req, probes)
            req.expected = row.generated
        br.answered = Answered("plain", len(rows), 1, asked, batch.plain.runs, batch.version)
        return outs
    return _round(batch, att, br, rows, on, plans, asked)


def _restore(br: BatchRounds, rows: Sequence[DecodeState], reqs: Sequence[RowRounds]) -> None:
    """Rows that started from the prompt cache: the drafter's state for the restored tokens, before
    their first sync (a family that restores nothing derives it from the row)."""
    for row, req in zip(rows, reqs):
        if req.restore is not None:
            saved, req.restore = req.restore, None
            try:
                br.draft.restore_row(row, saved, row.cached)
            except Exception as e:  # noqa: BLE001 - the row decodes plainly, nothing lost
                req.fall_back("restoring its state from the prompt cache", e)


def _fall_back(reqs: Sequence[RowRounds], where: str, error: BaseException) -> None:
    for req in reqs:
        req.fall_back(where, error)
    return None


class Fallback:
    """A round's guard: ``with fallback(where)`` turns a drafter failure in its block into plain decoding for
    the round's rows (``RowRounds.fall_back``; ``failed`` then says so), after ``undo`` (what the block opened).
    ``where``: what was going on, or a function of the error that says it; ``catch``: the failures it takes
    (anything else is raised)."""

    def __init__(self, reqs: Sequence[RowRounds]) -> None:
        self.reqs = reqs
        self.failed = False

    @contextmanager
    def __call__(self, where: Union[str, Callable[[BaseException], str]], catch: Tuple[type, ...] = (Exception,),
                 undo: Callable[[], None] = lambda: None) -> Iterator[None]:
        try:
            yield
        except catch as e:  # noqa: BLE001 - any drafter failure falls back, never loses tokens
            undo()
            self.failed = True
            _fall_back(self.reqs, where if isinstance(where, str) else where(e), e)


def _verify_failure(error: BaseException) -> str:
    # A target cache that cannot be rolled back exactly for this forward, or drafts outside the vocabulary.
    return "verifying (target cache)" if isinstance(error, UnsupportedCache) else "drafting"


def _round(batch: DecodeBatch, att: Any, br: BatchRounds, rows: List[DecodeState], on: List[int],
           plans: List[Optional[int]], asked: float) -> Optional[List[StepOutput]]:
    """One round for every row: propose -> verify -> accept -> commit, each step lapped (``Laps``, the names of
    ``metrics.ROUND_STEPS``). Up to the target's commit every cache is in a transaction: a failure rolls them all
    back and the rows decode plainly; the drafter failing after it leaves the target's tokens standing. ``asked``:
    when the host asked for this step (the round's price runs from there, ``_price``)."""
    reqs: List[RowRounds] = [rows[b].extras[NAME] for b in on]
    on_rows = [rows[b] for b in on]
    vocab = int(rows[0].pending_logprobs.shape[-1]) if rows[0].pending_logprobs is not None else 0
    lap, fallback = Laps(), Fallback(reqs)
    lazy = att.lazy_drafts and not any(r.logits_processors for r in rows)
    with fallback("drafting"), lap.phase("draft"):  # propose (draft.py: the drafter's own transactions open)
        drafted = draft(br.draft, on_rows, [k or 0 for k in plans], vocab, lazy)
    if fallback.failed:
        return None
    proposals = _per_row(len(rows), on, drafted.proposals)
    width_for = batch.target.cache_policy.verify_width
    with fallback(_verify_failure, (UnsupportedCache, DraftError)), commit.Open(drafted) as txns:
        with lap.phase("adopt"):  # the target's transaction begun; the verify the round before queued, if it fits
            target, got = _begin(batch, br, txns, proposals, vocab)
        with lap.phase("verify"):  # verify: one forward of the target, [B, W, V]
            logits, captured, inputs = _verify(batch, got, proposals, vocab, width_for, reqs[0].stats)
        with lap.phase("plan"):  # accept: each row's rule, on the device (accept.py)
            txns.fed = inputs
            accepting = RoundPlans(rows, proposals, logits, inputs, att.settings.acceptance)
            ahead = DraftAhead(att, br.draft, on_rows, lazy, accepting)
            # Queued before any drafting ahead, so that reading them waits for the verify alone.
            mx.async_eval(accepting.arrays, ahead.arrays)
        ahead.queue_next(lap, batch, rows, on, reqs, proposals, captured, inputs.shape[1], vocab, width_for)
        with lap.phase("read"):  # the host reads the outcome: one synchronisation for the batch
            proposals = as_ints(proposals, vocab)
            outcomes: List[RoundOutcome] = accepting.read(proposals)
        with lap.phase("commit"):  # commit the target's caches (commit.py)
            outcomes = commit.fit(target, outcomes, inputs.shape[1])
            commit.commit_target(target, outcomes, inputs.shape[1])
    if fallback.failed:
        return None
    with lap.phase("commit_drafter"), fallback(ahead.where, undo=drafted.abort):  # the target's tokens stand
        ahead.check()
        commit.commit_drafter(br.draft, drafted, on_rows, commit.verified(outcomes, captured, att.drafter.capture_layers(), on))
    record(rows, on, reqs, plans, outcomes, lap, int(inputs.shape[1]))
    br.answered = Answered("round", len(rows), int(inputs.shape[1]), asked, batch.plain.runs, batch.version)
    ahead.settle(br, reqs[0], lap)
    return [StepOutput([GeneratedToken(t, accepting.logprob(b, i)) for i, t in enumerate(o.tokens)])
            for b, o in enumerate(outcomes)]


def _per_row(n: int, on: Sequence[int], drafted: Sequence[Proposal]) -> List[Proposal]:
    """The proposals of the drafting rows (``on``) spread over the batch's ``n`` rows; the others propose none."""
    proposals: List[Proposal] = [Proposal([]) for _ in range(n)]
    for b, p in zip(on, drafted):
        proposals[b] = p
    return proposals


def _begin(batch: DecodeBatch, br: BatchRounds, txns: commit.Open, proposals: Sequence[Proposal],
           vocab: int) -> Tuple[CacheTransaction, Optional[Tuple[mx.array, Dict[int, mx.array], mx.array]]]:
    """The target's transaction over the verify forward, begun (a cache that keeps part of a forward by replaying
    it replays the verify's inputs), and the verify the round before queued where it is this round's (``adopt``,
    verify_ahead.py); the batch holds that one no longer, and neither does this frame once it returns (MLX
    writes a buffer in place only where nothing else holds it)."""
    waiting, br.queued = br.queued, None
    txns.target = CacheTransaction(batch.cache, replay=lambda n: replay(batch.target.model, batch.cache, txns.fed, n))
    txns.target.begin()
    return txns.target, adopt(waiting, batch, proposals, vocab)


def _verify(batch: DecodeBatch, adopted: Optional[Tuple[mx.array, Dict[int, mx.array], mx.array]],
            proposals: Sequence[Proposal], vocab: int, width_for: Callable[[int], int],
            stats: SpecStats) -> Tuple[mx.array, Dict[int, mx.array], mx.array]:
    """(logits [B, W, V], captured, inputs [B, W]): the verify the round before queued, where the round
    ``adopted`` it, else the target's forward over every row's block (verify.py)."""
    if adopted is None:
        return verify(batch, [p.tokens for p in proposals], vocab, width_for)
    stats.verified_ahead += 1
    return adopted


def record(rows: Sequence[DecodeState], on: Sequence[int], reqs: Sequence[RowRounds], plans: Sequence[Optional[int]],
           outcomes: Sequence[RoundOutcome], lap: Laps, width: int) -> None:
    """A round's outcome into each drafting row's block-size controller and stats, with its steps' times
    (the round's cost is taken when the host asks again: ``_price``)."""
    for b, req, plan in zip(on, reqs, plans):
        outcome = outcomes[b]
        if plan and outcome.draft_tokens:
            c = req.controller
            c.history.append(c.size)
            c.shape = (len(rows), width)
            c.update(outcome.accepted, outcome.draft_tokens)
            req.stats.record(outcome)
            req.stats.block_sizes = c.history
            req.stats.record_steps(lap)
        # A row that drafted nothing took its token from this forward: one of its plain steps,
        # counted by ``observe`` at the next step like the host's.
        req.expected = rows[b].generated + (len(outcome.tokens) if plan and outcome.draft_tokens else 0)
