"""One speculative round over a batch: draft (draft.py) -> verify (verify.py) -> accept (accept.py) -> commit (commit.py).

Before the host reads the outcome, a round may queue the next one's block (``DraftBatch.draft_ahead``) and
its verify (verify_ahead.py) from the outcome still on the device; the next round takes them up only where
everything is as they assumed.

Every row of the batch takes part: rows with drafts get their accepted drafts plus the bonus, rows
without (speculation off for the request, fallen back, paused by the adaptive controller, nothing
left to draft) take their one token from the same verify forward. When no row drafts, the plugin
declines the step and the host takes plain steps, as many as every row's controller allows.

Nothing is lost: a drafter that raises, or proposes tokens outside the vocabulary, leaves every
cache as it was before the round, and its rows go on with plain decoding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from ..drafters.base import DraftBatch, Proposal, Unread
from ..hooks.api import CacheTransaction, DecodeBatch, DecodeState, GeneratedToken, StepOutput, UnsupportedCache, replay
from . import commit
from .accept import RoundOutcome, plan_rows, read_plans, unread_outcome
from .adaptive import BlockSizeController
from .costs import expected_tokens
from .draft import DraftError, as_ints, draft
from .metrics import METRICS, PHASES, Laps, SpecStats
from .settings import SpeculativeSettings
from .verify import row_logprobs, verify
from .verify_ahead import Queued, adopt, queue, settle

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
class BatchRounds:
    """The plugin's state for one batch (``batch.extras[NAME]``): the drafter's rows."""

    draft: DraftBatch
    plain_runs: int = 0  # the host's plain runs on this batch seen so far
    queued: Optional[Queued] = None  # the next round's verify, queued by the last round (verify_ahead.py)
    extras: dict = field(default_factory=dict)


def row_rounds(state: DecodeState, att: Any) -> Optional[RowRounds]:
    """The request's rounds, made when the plugin first sees it; None: it decodes plainly."""
    req = state.extras.get(NAME)
    if req is None:
        if att.drafter is None or state.options.get("speculative") is False:
            state.extras[NAME] = False
            return None
        stats = SpecStats(kind=att.drafter.kind)
        state.report[NAME] = stats
        width_for = getattr(state.target.cache_policy, "verify_width", None) or (lambda n: n)
        req = RowRounds(
            controller=BlockSizeController(cap=att.max_block or att.block_size, start=att.block_size,
                                           adaptive=att.settings.adaptive and att.settings.block_size is None,
                                           costs=att.costs, width_for=width_for,
                                           shape_stable=bool(getattr(state.target.cache_policy, "shape_stable", False))),
            stats=stats, settings=att.settings, expected=state.generated,
        )
        saved = state.restored.get(NAME) if state.cached else None
        req.restore = saved.value if saved is not None else None
        state.extras[NAME] = req
    return req if req and req.failed is None else None


def _observe(batch: DecodeBatch, br: BatchRounds, rows: Sequence[DecodeState], reqs: Sequence[RowRounds]) -> None:
    """Count the plain steps the host took for each row since the plugin last answered, and their cost."""
    fresh_run = batch.plain.runs != br.plain_runs
    br.plain_runs = batch.plain.runs
    for row, req in zip(rows, reqs):
        if req.observe(row) and fresh_run and batch.plain.steps:
            req.controller.record_plain(batch.plain.steps, batch.plain.seconds, batch.plain.rows)


PROBE_EVERY = 8  # plain steps between asks while paused, where the drafter can tell a probe is worth it


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
    if getattr(row.target.cache_policy, "shape_stable", False):
        # Near the end of a request the block keeps its size: a smaller one is a shape the device meets for the
        # first time (seconds of compiling on MLX-CUDA, measured on an H100: bench/results/served/h100-batch-trace.json);
        # the tokens past the request's end are dropped by the host, as after a stop token.
        return c.size - 1
    return min(c.size - 1, row.remaining - 1)


def _grant(row: DecodeState, req: RowRounds, probes: bool) -> Optional[int]:
    """Plain steps the host may take for a row that does not draft (None: any number); ``probes``: the drafter
    tells when a probe is worth it (``DraftBatch.worth_probing``), so it is asked again every few steps."""
    if req.to_end:
        return None
    steps = req.controller.paused_left or 1
    return min(steps, PROBE_EVERY) if probes else steps


def _batch_loses(batch: DecodeBatch, att: Any, reqs: Sequence[RowRounds], plans: Sequence[Optional[int]]) -> str:
    """Why this round would yield fewer tokens per second than plain steps of the batch, at the costs measured
    for its shape and each drafting row's acceptance (rows that draft nothing yield their one token either way);
    "" where it would not."""
    if not all(q.controller.adaptive for q, k in zip(reqs, plans) if k):
        return ""  # a pinned block is the user's choice
    width_for = getattr(batch.target.cache_policy, "verify_width", None) or (lambda n: n)
    rows = len(batch.rows)
    width = width_for(1 + max(k or 0 for k in plans))
    expected = rows - sum(1 for k in plans if k) + sum(expected_tokens(q.controller.alpha, k) for q, k in zip(reqs, plans) if k)
    if not att.costs.round_loses(rows, width, expected):
        return ""
    r, p = att.costs.get("round", rows, width), att.costs.get("plain", rows, 1)
    return f"{rows}x{width} round {1e3 * r:.1f} ms for {expected:.1f} tokens, plain step {1e3 * p:.1f} ms"


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
    _restore(br, [rows[b] for b in on], [reqs[b] for b in on])
    on = [b for b in on if reqs[b].failed is None]
    if not on:
        return None
    on_rows, on_reqs = [rows[b] for b in on], [reqs[b] for b in on]
    _observe(batch, br, on_rows, on_reqs)
    try:
        br.draft.sync(on_rows)
    except Exception as e:  # noqa: BLE001 - any drafter failure falls back, never loses tokens
        return _fall_back(on_reqs, "syncing its rows", e)
    for req in on_reqs:
        req.synced = True
    plans = [_plan(r, q, br.draft) for r, q in zip(on_rows, on_reqs)]
    loses = _batch_loses(batch, att, on_reqs, plans) if any(plans) else ""
    if loses:
        for req, k in zip(on_reqs, plans):
            if k:
                req.controller.pause_now(loses)
        plans = [None] * len(plans)
    if not any(plans):
        outs = [StepOutput([], None) for _ in rows]
        probes = type(br.draft).worth_probing is not DraftBatch.worth_probing
        for b, row, req in zip(on, on_rows, on_reqs):
            outs[b].plain_steps = _grant(row, req, probes)
            req.expected = row.generated
        return outs
    return _round(batch, att, br, rows, on, plans)


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


def _round(batch: DecodeBatch, att: Any, br: BatchRounds, rows: List[DecodeState], on: List[int],
           plans: List[Optional[int]]) -> Optional[List[StepOutput]]:
    reqs: List[RowRounds] = [rows[b].extras[NAME] for b in on]
    on_rows = [rows[b] for b in on]
    vocab = int(rows[0].pending_logprobs.shape[-1]) if rows[0].pending_logprobs is not None else 0
    lap = Laps()
    lazy = att.lazy_drafts and not any(r.logits_processors for r in rows)
    try:
        drafted = draft(br.draft, on_rows, [k or 0 for k in plans], vocab, lazy)
    except Exception as e:  # noqa: BLE001
        return _fall_back(reqs, "drafting", e)
    lap("draft")
    proposals: List[Proposal] = [Proposal([]) for _ in rows]
    for b, p in zip(on, drafted.proposals):
        proposals[b] = p
    width_for = getattr(batch.target.cache_policy, "verify_width", lambda n: n)
    target: Optional[CacheTransaction] = None
    ahead_error: Optional[BaseException] = None
    waiting, br.queued = br.queued, None
    queued: Optional[Queued] = None
    try:
        fed: List[Any] = []
        target = CacheTransaction(batch.cache, replay=lambda n: replay(batch.target.model, batch.cache, fed[0], n))
        target.begin()
        got = adopt(waiting, batch, proposals, vocab)
        waiting = None  # its buffers held no longer (MLX writes a buffer in place only where nothing else holds it)
        lap("adopt")
        if got is None:
            logits, captured, inputs = verify(batch, [p.tokens for p in proposals], vocab, width_for)  # [B, W, V]
        else:
            logits, captured, inputs = got  # queued by the round before
            reqs[0].stats.verified_ahead += 1
        lap("verify")
        fed.append(inputs)
        drafts = [inputs[b, 1 : 1 + len(p.tokens)] for b, p in enumerate(proposals)]  # [k_b] as fed
        logprobs = [row_logprobs(row, logits[b : b + 1], p.tokens) for b, (row, p) in enumerate(zip(rows, proposals))]
        accepting = plan_rows(rows, proposals, drafts, logprobs, att.settings.acceptance)
        ahead = att.ahead and lazy and br.draft.drafts_ahead(on_rows)
        unread = [unread_outcome(plan, x) for plan, x in zip(accepting, drafts)] if ahead else []
        # Queued before any drafting ahead, so that reading them waits for the verify alone.
        mx.async_eval([x for _, x in accepting], [u for u in unread if u is not None])
        lap("plan")
        if ahead:
            ahead_error = draft_ahead(br.draft, rows, on, [len(proposals[b].tokens) for b in on], unread, captured)
            lap("draft_ahead")
            if ahead_error is None and att.verify_ahead and next_round_alike(rows, on, reqs, proposals):
                try:
                    queued = queue(batch, br.draft, unread[0], inputs.shape[1], vocab, width_for)
                except Exception as e:  # noqa: BLE001 - like a failing ahead: falls back after the commit
                    ahead_error = e
                lap("queue")
        proposals = as_ints(proposals, vocab)
        outcomes: List[RoundOutcome] = read_plans(accepting, proposals)
        lap("read")
        outcomes = commit.fit(target, outcomes, inputs.shape[1])
        commit.commit_target(target, outcomes, inputs.shape[1])
        lap("commit")
    except (UnsupportedCache, DraftError) as e:
        # A target cache that cannot be rolled back exactly for this forward, or drafts outside the
        # vocabulary: everything is restored, the rows go on with plain decoding, nothing lost.
        commit.abort(target, drafted)
        where = "verifying (target cache)" if isinstance(e, UnsupportedCache) else "drafting"
        return _fall_back(reqs, where, e)
    except BaseException:
        commit.abort(target, drafted)
        raise
    try:
        if ahead_error is not None:
            raise ahead_error
        commit.commit_drafter(br.draft, drafted, on_rows,
                              commit.verified(outcomes, captured, att.drafter.capture_layers(), on))
    except Exception as e:  # noqa: BLE001 - the target's tokens stand; the drafter is done for
        drafted.abort()
        _fall_back(reqs, "drafting ahead" if e is ahead_error else "committing", e)
    lap("commit_drafter")
    record(rows, on, reqs, plans, outcomes, lap, int(inputs.shape[1]))
    if queued is not None and ahead_error is None and reqs[0].failed is None:
        br.queued = settle(queued, reqs[0].expected)
        lap("settle")
        reqs[0].stats.record_steps(lap, "settle")
    return [StepOutput([GeneratedToken(t, logprobs[b][i]) for i, t in enumerate(o.tokens)])
            for b, o in enumerate(outcomes)]


def next_round_alike(rows: Sequence[DecodeState], on: Sequence[int], reqs: Sequence[RowRounds],
                     proposals: Sequence[Proposal]) -> bool:
    """Whether the next round of this one-row batch will want no more drafts than this one, whatever this
    round accepts (so that a verify queued over as many is likely to serve it): a pinned block or one at its
    cap (the controller only grows below it), and tokens left for a round after this one's."""
    if len(rows) != 1 or list(on) != [0]:
        return False
    c, k = reqs[0].controller, len(proposals[0].tokens)
    return (not c.adaptive or c.size >= c.cap) and rows[0].remaining - (k + 1) >= 2


def draft_ahead(drafter: DraftBatch, rows: Sequence[DecodeState], on: Sequence[int], max_drafts: Sequence[int],
                unread: Sequence[Optional[Any]], captured: Dict[int, mx.array]) -> Optional[BaseException]:
    """The drafter's next block queued from this round's unread outcome (``DraftBatch.draft_ahead``);
    an exception is returned, for the round to fall back after committing the target's tokens."""
    outcomes: List[Optional[Unread]] = []
    for b in on:
        u = unread[b]
        outcomes.append(None if u is None else Unread(u[0], u[1], {i: h[b : b + 1] for i, h in captured.items()}))
    try:
        drafter.draft_ahead([rows[b] for b in on], outcomes, max_drafts)
    except Exception as e:  # noqa: BLE001 - any drafter failure falls back, never loses tokens
        return e
    return None


def record(rows: Sequence[DecodeState], on: Sequence[int], reqs: Sequence[RowRounds], plans: Sequence[Optional[int]],
           outcomes: Sequence[RoundOutcome], lap: Laps, width: int) -> None:
    """A round's outcome into each drafting row's block-size controller and stats, with its steps' times
    (the round's cost, of ``len(rows)`` rows x ``width``, into the target's cost table once)."""
    drafting, verifying = lap.total(*PHASES["draft"]), lap.total(*PHASES["verify"])
    timed = False
    for b, req, plan in zip(on, reqs, plans):
        outcome = outcomes[b]
        if plan and outcome.draft_tokens:
            c = req.controller
            c.history.append(c.size)
            c.shape = (len(rows), width)
            if not timed:
                c.record_round(drafting + verifying)
                timed = True
            c.update(outcome.accepted, outcome.draft_tokens)
            req.stats.record(outcome)
            req.stats.block_sizes = c.history
            req.stats.record_steps(lap)
        # A row that drafted nothing took its token from this forward: one of its plain steps,
        # counted by ``observe`` at the next step like the host's.
        req.expected = rows[b].generated + (len(outcome.tokens) if plan and outcome.draft_tokens else 0)
