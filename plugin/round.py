"""One speculative round: draft -> verify -> accept -> commit.

Nothing is lost: a drafter that raises leaves every cache as it was before the round and the
request goes on with plain one-token decoding.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Type

import mlx.core as mx

from ..drafters.base import DraftSession
from ..hooks.state import DecodeState, GeneratedToken, StepOutput
from . import accept
from .adaptive import BlockSizeController
from .commit import CacheTransaction, UnsupportedCache
from .metrics import METRICS, SpecStats
from .settings import SpeculativeSettings
from .types import Proposal, RoundOutcome
from .verify import verify

log = logging.getLogger("mlx_speculative")
# MLX_SPEC_LAZY_DRAFTS=0: evaluate each proposal before the verify is built (for measurements).
LAZY_DRAFTS = os.environ.get("MLX_SPEC_LAZY_DRAFTS", "1").strip() != "0"


@dataclass
class RequestRounds:
    """A request's speculative state: its draft session, block-size controller and stats."""

    session: DraftSession
    controller: BlockSizeController
    stats: SpecStats
    settings: SpeculativeSettings
    failed: Optional[str] = None
    vocab_size: int = 0
    extras: dict = field(default_factory=dict)
    # (perf_counter, steps) when plain steps were handed out: their cost is measured at the next call.
    plain_clock: Optional[Tuple[float, int]] = None

    def fall_back(self, where: str, error: BaseException) -> None:
        self.failed = f"drafter failed while {where}: {type(error).__name__}: {error}"
        self.stats.fallback = self.failed
        METRICS.record_fallback()
        log.warning("speculative decoding: %s; continuing with plain decoding", self.failed)


def _propose(state: DecodeState, req: RequestRounds, max_drafts: int, lazy: bool = False) -> Proposal:
    """The drafter's proposal, checked. ``lazy``: a drafter's token array may stay unevaluated
    (checked after the verify, ``check_lazy_drafts``); otherwise tokens become ints here."""
    proposal = req.session.propose(state, max_drafts)
    tokens = proposal.tokens
    if isinstance(tokens, mx.array):
        if tokens.ndim != 1 or not mx.issubdtype(tokens.dtype, mx.integer):
            raise ValueError(f"draft tokens: expected a list of ints or a 1-d integer array; got an array of shape "
                             f"{tuple(tokens.shape)} and dtype {tokens.dtype}")
        tokens = tokens[:max_drafts]
        if not lazy:
            tokens = tokens.tolist()
    if not isinstance(tokens, mx.array):
        tokens = _in_vocabulary(req, [int(t) for t in tokens[:max_drafts]], ValueError)
    k = len(tokens)
    q = proposal.logprobs[:k] if proposal.logprobs is not None else None
    if q is not None and req.vocab_size and tuple(q.shape) != (k, req.vocab_size):
        raise ValueError(f"draft log-probabilities q have shape {tuple(q.shape)}; expected "
                         f"({k}, {req.vocab_size}): one row per draft token over the target's vocabulary")
    return Proposal(tokens, q)


class DraftError(ValueError):
    """A drafter's output found unusable after the verify was queued (the round is rolled back)."""


def _in_vocabulary(req: RequestRounds, tokens: List[int], error: Type[Exception]) -> List[int]:
    bad = [t for t in tokens if not 0 <= t < req.vocab_size]
    if bad:
        raise error(f"draft tokens {bad[:4]} are outside the target's vocabulary (0..{req.vocab_size - 1})")
    return tokens


def check_lazy_drafts(req: RequestRounds, proposal: Proposal) -> Proposal:
    """After the verify: the drafts as ints; out-of-vocabulary drafts raise ``DraftError``."""
    if not isinstance(proposal.tokens, mx.array):
        return proposal
    return Proposal(_in_vocabulary(req, proposal.tokens.tolist(), DraftError), proposal.logprobs)


def _accept(state: DecodeState, req: RequestRounds, proposal: Proposal, logprobs: mx.array) -> RoundOutcome:
    drafts = mx.array(proposal.tokens, dtype=mx.uint32)  # [k]
    if state.sampling.greedy:
        a, bonus = accept.greedy_accept(drafts, logprobs)
    elif req.settings.acceptance == "rejection":
        # p: the target's rows after the sampler's processing; q comes processed from the drafter.
        a, bonus = accept.rejection_accept(drafts, proposal.logprobs, state.sampling.process(logprobs), state.next_key())
        mx.eval(a, bonus)
        a, bonus = int(a.item()), int(bonus.item())
    else:
        a, bonus = accept.exact_accept(drafts, logprobs, state.sampler)
    return RoundOutcome(draft_tokens=len(proposal.tokens), accepted=a, tokens=proposal.tokens[:a] + [bonus])


def draft_block(
    state: DecodeState, req: RequestRounds, lazy: bool = False, plain_run: bool = True
) -> Optional[Tuple[Proposal, CacheTransaction, int]]:
    """Draft this round: the proposal, the drafter caches' open transaction and the block size.

    None when this step is a plain one-token step (fallen back, paused, nothing left to draft or
    nothing drafted); the drafter's caches are then already committed or rolled back. While the
    block-size controller pauses rounds, ``plain_run`` hands the host the whole pause at once
    (``state.plain_run``, pipelined plain steps); otherwise one plain step is taken per call.
    ``lazy``: the proposal's tokens may be an unevaluated array (see ``_propose``).
    """
    if req.failed is not None:
        return None
    now = time.perf_counter()
    if req.plain_clock is not None:
        req.controller.record_plain(req.plain_clock[1], now - req.plain_clock[0])
        req.plain_clock = None
    limit = state.remaining if plain_run else 1
    paused = req.controller.take_plain_steps(limit)
    if not paused and req.controller.skip_probe(state.remaining):
        paused = req.controller.plain_to_end(limit)
    if paused:
        state.plain_run = paused
        req.plain_clock = (now, paused)
        req.stats.plain_steps = req.controller.plain_steps
        return None
    block = req.controller.size
    max_drafts = min(block - 1, state.remaining - 1)
    if max_drafts < 1:
        return None
    # replay: recurrent caches (ArraysCache) keep a partial commit by feeding the kept tokens again.
    draft_txn = CacheTransaction(req.session.caches(), replay=getattr(req.session, "replay", None)).begin()
    try:
        proposal = _propose(state, req, max_drafts, lazy)
    except Exception as e:  # noqa: BLE001 - any drafter failure falls back, never loses tokens
        draft_txn.abort()
        req.fall_back("drafting", e)
        return None
    if not len(proposal.tokens):
        # Nothing to verify: keep what the drafter fed (catching up), let the host step.
        _session_commit(state, req, draft_txn, 0, 0)
        return None
    return proposal, draft_txn, block


def emit(state: DecodeState, outcome: RoundOutcome, logprobs: mx.array) -> StepOutput:
    """Append the verified tokens to the request; the target's caches already hold the kept positions."""
    state.keep_captures(outcome.emitted)
    emitted = [GeneratedToken(t, logprobs[i]) for i, t in enumerate(outcome.tokens)]
    state.tokens.extend(outcome.tokens)
    state.pending_logprobs = emitted[-1].logprobs
    return StepOutput(emitted)


def finish_round(
    state: DecodeState, req: RequestRounds, draft_txn: CacheTransaction, block: int, outcome: RoundOutcome,
    draft_seconds: float, verify_seconds: float,
) -> None:
    """After ``emit``: the drafter's commit, the block-size controller and the stats."""
    t = time.perf_counter()
    _session_commit(state, req, draft_txn, outcome.accepted, outcome.draft_tokens)
    req.controller.history.append(block)
    req.controller.record_round(draft_seconds + verify_seconds)
    req.controller.update(outcome.accepted, outcome.draft_tokens)
    req.stats.record(outcome)
    req.stats.block_sizes = req.controller.history
    req.stats.plain_steps = req.controller.plain_steps
    req.stats.seconds["draft"] += draft_seconds
    req.stats.seconds["verify"] += verify_seconds
    req.stats.seconds["commit"] += time.perf_counter() - t


def run_round(state: DecodeState, req: RequestRounds) -> Optional[StepOutput]:
    """Run one round, or return None for a plain one-token step (nothing to draft, or fallen back)."""
    t0 = time.perf_counter()
    # Lazy drafts: the verify is queued behind the drafter's kernels, so the CPU builds the verify
    # graph while the GPU drafts (one synchronisation per round). Logits processors need the
    # drafts as ints to build their per-position histories.
    drafted = draft_block(state, req, lazy=LAZY_DRAFTS and not state.logits_processors)
    if drafted is None:
        return None
    proposal, draft_txn, block = drafted
    t1 = time.perf_counter()

    def fed(n: int) -> list:
        return ([state.pending] + list(proposal.tokens))[:n]

    try:
        with CacheTransaction(state.cache, replay=lambda n: state.forward(fed(n))) as txn:
            logprobs = verify(state, proposal.tokens, req.vocab_size)  # [k+1, V]
            proposal = check_lazy_drafts(req, proposal)
            outcome = _accept(state, req, proposal, logprobs)
            txn.commit(outcome.emitted)
    except UnsupportedCache as e:
        # A target cache that cannot be rolled back exactly for this forward; the transaction
        # restored its start state, so the request goes on with plain decoding, losing nothing.
        draft_txn.abort()
        req.fall_back("verifying (target cache)", e)
        return None
    except DraftError as e:
        # Out-of-vocabulary lazy drafts, found after the verify: everything rolled back, as for
        # any drafter failure.
        draft_txn.abort()
        req.fall_back("drafting", e)
        return None
    except BaseException:
        draft_txn.abort()
        raise
    out = emit(state, outcome, logprobs)
    finish_round(state, req, draft_txn, block, outcome, t1 - t0, time.perf_counter() - t1)
    return out


def _session_commit(
    state: DecodeState, req: RequestRounds, draft_txn: CacheTransaction, accepted: int, drafted: int
) -> None:
    """The drafter keeps what matches the committed tokens; a failure rolls its caches back."""
    try:
        draft_txn.commit(req.session.commit(state, accepted, drafted))
    except Exception as e:  # noqa: BLE001
        draft_txn.abort()
        req.fall_back("committing", e)
