"""Drafting a round: the drafter's proposals for the rows of a batch, checked, inside transactions.

The drafter first catches up with what was committed since its rows last drafted (``prepare``: kept
whatever the round decides), then proposes inside cache transactions over the caches it writes
(``cache_groups``), which the round commits or rolls back with the target's (``commit.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafters.base import DraftBatch, Proposal
from ..hooks.api import WARMUP_CONTINUATION, CacheTransaction, knobs

AHEAD_ENV = "MLX_SPEC_DRAFT_AHEAD"
AHEAD_MODES = ("on", "verify", "off")


def ahead_mode(mode: Optional[str] = None, source: str = AHEAD_ENV) -> str:
    """What rounds queue before the host reads their outcome, where the drafter can: ``mode``, or
    $MLX_SPEC_DRAFT_AHEAD: on (the default: the next block, ``DraftBatch.draft_ahead``) | verify (the block and
    the next verify built over it, run when the next round adopts it; opt-in, plugin/cuda/verify_ahead.py says why) | off.
    Without ``mode``: ``runtime.draft_ahead`` / $MLX_SPEC_DRAFT_AHEAD (hooks/knobs.py)."""
    if not mode:
        mode, _, source = knobs.setting("draft_ahead")
    mode = mode.strip().lower()
    if mode not in AHEAD_MODES:
        raise ValueError(f"{source}: got {mode!r}; allowed: {', '.join(AHEAD_MODES)}")
    return mode


def ahead_modes(spec: str, source: str = "--draft-ahead") -> List[str]:
    """Several modes, distinct, joined by commas (the bench runs a twin method per further mode), or both (on,off)."""
    modes = ["on", "off"] if spec.strip() == "both" else [m.strip() for m in spec.split(",")]
    if any(m not in AHEAD_MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"{source}: got {spec!r}; allowed: {', '.join(AHEAD_MODES)}, distinct ones joined by commas, "
                         "or both")
    return modes


class DraftError(ValueError):
    """A drafter's output is unusable (the round is rolled back and its rows decode plainly)."""


@dataclass
class Drafted:
    proposals: List[Proposal]  # one per drafting row
    txns: List[Tuple[CacheTransaction, List[int]]]  # the drafter's open transactions and their rows

    def abort(self) -> None:
        for txn, _ in self.txns:
            txn.abort()


def check(proposal: Proposal, max_drafts: int, vocab_size: int, lazy: bool) -> Proposal:
    """The proposal cut to ``max_drafts``; ints unless ``lazy`` lets an array stay unevaluated
    (checked after the verify by ``in_vocabulary``)."""
    tokens = proposal.tokens
    if isinstance(tokens, mx.array):
        if tokens.ndim != 1 or not mx.issubdtype(tokens.dtype, mx.integer):
            raise DraftError(f"draft tokens: expected a list of ints or a 1-d integer array; got an array of shape "
                             f"{tuple(tokens.shape)} and dtype {tokens.dtype}")
        if tokens.shape[0] > max_drafts:  # a slice is a new op: read, it would wait for all work queued by then
            tokens = tokens[:max_drafts]
        if not lazy:
            tokens = tokens.tolist()
    if not isinstance(tokens, mx.array):
        tokens = in_vocabulary([int(t) for t in tokens[:max_drafts]], vocab_size)
    k = len(tokens)
    q = proposal.logprobs[:k] if proposal.logprobs is not None else None
    if q is not None and vocab_size and tuple(q.shape) != (k, vocab_size):
        raise DraftError(f"draft log-probabilities q have shape {tuple(q.shape)}; expected "
                         f"({k}, {vocab_size}): one row per draft token over the target's vocabulary")
    return Proposal(tokens, q)


def in_vocabulary(tokens: List[int], vocab_size: int) -> List[int]:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if vocab_size and bad:
        raise DraftError(f"draft tokens {bad[:4]} are outside the target's vocabulary (0..{vocab_size - 1})")
    return tokens


def as_ints(proposals: Sequence[Proposal], vocab_size: int) -> List[Proposal]:
    """After the verify: every proposal's tokens as ints; out-of-vocabulary drafts raise ``DraftError``."""
    # Each array read as it is: evaluated ones (drafted ahead) without waiting for the work queued after them
    # (verifying ahead), as a new op (a concatenation) would.
    values = iter([t for p in proposals if isinstance(p.tokens, mx.array) for t in p.tokens.tolist()])
    out = []
    for p in proposals:
        if isinstance(p.tokens, mx.array):
            p = Proposal(in_vocabulary([next(values) for _ in range(p.tokens.shape[0])], vocab_size), p.logprobs)
        out.append(p)
    return out


def teacher(row: Any, proposal: Proposal, vocab_size: int) -> Proposal:
    """The server's warm-up (hooks/warmup.py): the row's drafts taken from the target's own continuation of its prompt,
    right for the whole block, half of it or none of it, so the warm-up meets accepted, partly accepted and rejected
    rounds whatever the drafter proposed (its forward ran: its shapes are met too). The verify
    still decides every token; outside the warm-up, proposals pass unchanged."""
    reference = row.options.get(WARMUP_CONTINUATION)
    k = len(proposal.tokens)  # ``check``'s proposal: a list or a 1-d array
    if not reference or not k:
        return proposal
    sequence = list(row.tokens[: row.prompt_len]) + list(reference)
    start = len(row.tokens)  # row.tokens ends with the pending token: the drafts follow it
    # Whole, half or none right, by the position spread by a multiplicative hash: a rule on the generated count's
    # parity stuck at one kind (each half-accepted round of 3 drafts advances 2 positions).
    cut = (k, k // 2, 0)[((start * 2654435761) % 2 ** 32 >> 16) % 3]
    tokens = [sequence[i] if i < len(sequence) else 0 for i in range(start, start + k)]
    tokens = [t if i < cut else (t + 1) % max(vocab_size, 1) for i, t in enumerate(tokens)]
    if isinstance(proposal.tokens, mx.array):
        return Proposal(mx.array(tokens, dtype=proposal.tokens.dtype), proposal.logprobs)
    return Proposal(tokens, proposal.logprobs)


def draft(drafter: DraftBatch, rows: Sequence[Any], max_drafts: Sequence[int], vocab_size: int, lazy: bool) -> Drafted:
    """Catch the drafter up, open its transactions, take and check its proposals.

    Raises whatever the drafter raises; its transactions are then rolled back."""
    drafter.prepare(rows)
    groups = drafter.cache_groups()
    replay = getattr(drafter, "replay_group", None)
    txns = [(CacheTransaction(caches, replay=(lambda n, g=g: replay(g, n)) if replay else None).begin(), list(idx))
            for g, (caches, idx) in enumerate(groups)]
    drafted = Drafted([], txns)
    try:
        proposals = drafter.propose(rows, max_drafts)
        if len(proposals) != len(rows):
            raise DraftError(f"the drafter returned {len(proposals)} proposals for {len(rows)} rows")
        drafted.proposals = [teacher(row, check(p, m, vocab_size, lazy), vocab_size)
                             for row, p, m in zip(rows, proposals, max_drafts)]
    except BaseException:
        drafted.abort()
        raise
    return drafted
