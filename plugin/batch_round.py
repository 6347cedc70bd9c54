"""A batched speculative round: each row drafts on its own, ONE verify forward of the target for all rows.

Row b feeds ``[pending_b, *drafts_b]`` padded to the longest block with filler positions after its
real ones (causal attention keeps them out of the real positions; they are never committed).
Acceptance is per row (greedy / rejection with the row's own key / exact), with the row's own
logits processors on its own history; the batch caches commit per-row lengths through one
``CacheTransaction`` (``BatchKVCache`` rows are ragged: a row that keeps fewer positions gets the
rest as left padding). Rows without a round this step (speculation off or fallen back, the
controller's plain steps, nothing drafted) take their one-token step in the same forward.

A drafter that fails in one row rolls back that row's draft caches and the row goes on with plain
steps; the other rows and the batch caches are unaffected.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import mlx.core as mx

from ..hooks.batch import DecodeBatch
from ..hooks.state import StepOutput
from . import accept
from .commit import CacheTransaction
from .round import RequestRounds, _accept, draft_block, emit, finish_round
from .types import Proposal, RoundOutcome

# Drafter kinds whose sessions hold only per-request state (their own caches, the row's tokens, its
# captures: DecodeBatch.forward records each row's slice), so their rows can share a verify forward.
BATCHABLE_KINDS = ("draft_model", "ngram", "dflash")


def refusal(kind: str) -> Optional[str]:
    if kind not in BATCHABLE_KINDS:
        return f"drafter kind {kind!r} is not known to keep per-request state (batched: {', '.join(BATCHABLE_KINDS)})"
    return None


def run_batch_round(batch: DecodeBatch, reqs: Sequence[Optional[RequestRounds]]) -> List[StepOutput]:
    """One decode step for every row of ``batch``; ``reqs[b]`` is row b's rounds (None: plain steps)."""
    rows = batch.rows
    if len(reqs) != len(rows):
        raise ValueError(f"expected one RequestRounds (or None) per row: {len(rows)} rows, got {len(reqs)}")
    proposals: List[Proposal] = []
    draft_txns: List[Optional[CacheTransaction]] = []
    blocks: List[int] = []
    draft_seconds: List[float] = []
    for state, req in zip(rows, reqs):
        ts = time.perf_counter()
        drafted = draft_block(state, req, plain_run=False) if req is not None else None
        proposal, txn, block = drafted if drafted is not None else (Proposal([]), None, 0)
        proposals.append(proposal)
        draft_txns.append(txn)
        blocks.append(block)
        draft_seconds.append(time.perf_counter() - ts)
    t1 = time.perf_counter()

    width = 1 + max(len(p.tokens) for p in proposals)
    inputs = [[s.pending, *p.tokens] + [s.pending] * (width - 1 - len(p.tokens)) for s, p in zip(rows, proposals)]
    outcomes: List[Optional[RoundOutcome]] = [None] * len(rows)
    try:
        with CacheTransaction(batch.cache) as txn:
            logits = batch.forward(inputs)  # [B, W, V]
            logprobs = [s.logprobs(logits[b : b + 1, : len(p.tokens) + 1], p.tokens)  # each [k_b+1, V]
                        for b, (s, p) in enumerate(zip(rows, proposals))]
            # Greedy rows (argmax p, as mlx-lm's temperature-0 sampler) in the same evaluation:
            # one synchronisation for the batch instead of two per row.
            greedy = {b: mx.argmax(lp, axis=-1) for b, (s, lp) in enumerate(zip(rows, logprobs)) if s.sampling.greedy}
            mx.eval(logprobs, list(greedy.values()))
            sampled = {}
            for b, (state, req, proposal) in enumerate(zip(rows, reqs, proposals)):
                drafts = proposal.tokens
                if b in greedy:
                    a, bonus = accept.accept_prefix(drafts, greedy[b].tolist())  # y: [k+1]
                    outcomes[b] = RoundOutcome(draft_tokens=len(drafts), accepted=a, tokens=drafts[:a] + [bonus])
                elif drafts:
                    outcomes[b] = _accept(state, req, proposal, logprobs[b])
                else:
                    sampled[b] = state.sampler(logprobs[b])  # the row's one-token step
            mx.eval(list(sampled.values()))
            for b, t in sampled.items():
                outcomes[b] = RoundOutcome(draft_tokens=0, accepted=0, tokens=[int(t.item())])
            txn.commit([o.emitted for o in outcomes if o is not None])
    except BaseException:
        for t in draft_txns:
            if t is not None:
                t.abort()
        raise
    t2 = time.perf_counter()

    out: List[StepOutput] = []
    for b, (state, req, outcome) in enumerate(zip(rows, reqs, outcomes)):
        assert outcome is not None
        out.append(emit(state, outcome, logprobs[b]))
        if outcome.draft_tokens:
            # The verify forward is shared: each row is charged its share.
            finish_round(state, req, draft_txns[b], blocks[b], outcome, draft_seconds[b], (t2 - t1) / len(rows))
    return out
