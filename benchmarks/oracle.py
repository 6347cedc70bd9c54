"""Oracle acceptance: the drafter runs for real, its proposals are replaced by the target's own
greedy continuation with errors injected so that the mean acceptance length is a chosen tau.

Each draft position is right with probability alpha, independently, until the first wrong one
(later positions in the round do not matter). With k draft tokens per round the mean accepted
count is alpha (1 - alpha^k) / (1 - alpha); ``alpha_for_tau`` solves it for tau - 1 at the
block cap. The same alpha drives mlx-lm's own loop (``OracleDraftLM``), so both see the same
acceptance process.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafters.base import DraftBatch, Drafter, ForwardingDraftBatch, Proposal, Unread, Verified


def expected_accepted(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k)
    return alpha * (1 - alpha**k) / (1 - alpha)


def alpha_for_tau(tau: float, block_size: int) -> float:
    """Per-position acceptance probability giving mean acceptance length ``tau`` with blocks of ``block_size``."""
    k = block_size - 1
    if not 1.0 <= tau <= block_size:
        raise ValueError(f"--oracle-acceptance: got tau {tau}; allowed: 1 to the block size ({block_size})")
    if tau >= block_size:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_accepted(mid, k) < tau - 1 else (lo, mid)
    return (lo + hi) / 2


class Oracle:
    """The reference continuation of one request and the random error process."""

    def __init__(self, alpha: float, vocab_size: int, seed: int = 0):
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.sequence: List[int] = []  # prompt + reference continuation
        self.prompt_len = 0
        self.sequences: Dict[Tuple[int, ...], List[int]] = {}  # per prompt, for several requests
        self._device: Tuple[Optional[List[int]], Any] = (None, None)  # (sequence, it on the device)

    def set_request(self, prompt: Sequence[int], continuation: Sequence[int], seed: int) -> None:
        self.sequence = list(prompt) + list(continuation)
        self.prompt_len = len(prompt)
        self.rng = random.Random(seed)

    def register(self, prompt: Sequence[int], continuation: Sequence[int]) -> None:
        """A reference for requests with this prompt (several requests in flight: a server)."""
        self.sequences[tuple(prompt)] = list(prompt) + list(continuation)

    def token(self, position: int, right: bool, sequence: Optional[List[int]] = None) -> int:
        """The reference token at absolute ``position`` (or a wrong one)."""
        seq = self.sequence if sequence is None else sequence
        ref = seq[position] if position < len(seq) else 0
        return ref if right else (ref + 1) % self.vocab_size

    def draw(self) -> bool:
        return self.rng.random() < self.alpha

    def pattern(self, k: int) -> List[bool]:
        """Which of k proposals are right: right until the first error (no draws after it)."""
        out: List[bool] = []
        right = True
        for _ in range(k):
            right = right and self.draw()
            out.append(right)
        return out

    def drafts(self, start: int, k: int, sequence: Optional[List[int]] = None) -> List[int]:
        """k proposals for absolute positions start..start+k-1: right until the first error."""
        return [self.token(start + i, right, sequence) for i, right in enumerate(self.pattern(k))]

    def sequence_for(self, row: Any) -> List[int]:
        return self.sequences.get(tuple(row.tokens[: row.prompt_len])) or self.sequence

    def drafts_for(self, row: Any, k: int) -> List[int]:
        """k proposals after the row's tokens (its pending token last), from its prompt's reference."""
        return self.drafts(len(row.tokens), k, self.sequence_for(row))

    def drafts_at(self, row: Any, shift: mx.array, k: int) -> mx.array:
        """``drafts_for`` on the device [k], for the row once ``shift`` (a device scalar) more tokens follow it."""
        sequence = self.sequence_for(row)
        if self._device[0] is not sequence:
            self._device = (sequence, mx.array(sequence + [0] * 64, dtype=mx.int32))
        ref = self._device[1]
        at = mx.minimum(len(row.tokens) + shift.astype(mx.int32) + mx.arange(k, dtype=mx.int32), ref.shape[0] - 1)
        truth = mx.take(ref, at)  # [k]
        return mx.where(mx.array(self.pattern(k)), truth, (truth + 1) % self.vocab_size)


class AheadDrafts(NamedTuple):
    """The oracle's drafts for the next round, drawn when the round before queued its verify (``ahead_drafts``)."""

    row: Any
    length: int  # the row's tokens then
    accepted: mx.array  # []: the a they assumed (the row then has length + a + 1 tokens)
    drafts: mx.array  # [k]


class OracleBatch(ForwardingDraftBatch):
    """Any drafter's batch, wrapped: records how many tokens each round drafted (per-position
    acceptance), and with an ``oracle`` replaces the proposals by the oracle's after the drafter
    really ran (its cost counts; its tokens do not)."""

    # Not the inner batch's: whether a paused row probes (the oracle decides what is accepted). The prompt cache's
    # saved drafter state is the inner batch's, as a deployment's real drafter keeps it: with the defaults a served
    # benchmark's speculative requests found no usable entry and prefilled every prompt whole, while plain
    # requests reused theirs (a 256-word prompt: 38.5 against 14.9 ms on an H100, 14% of the generation thread at
    # 8 clients against 3%).
    worth_probing = DraftBatch.worth_probing

    def __init__(self, inner: DraftBatch, drafted: List[int], oracle: Optional[Oracle]):
        super().__init__(inner)
        self.drafted = drafted
        self.oracle = oracle
        self.inner_k: List[int] = []
        self.ahead: Optional[AheadDrafts] = None

    def propose(self, rows: Sequence[Any], max_drafts: Sequence[int]) -> List[Proposal]:
        real = self.inner.propose(rows, max_drafts)
        self.inner_k = [len(p.tokens) for p in real]
        ahead, self.ahead = self.ahead, None
        if self.oracle is None:
            out = real
        elif ahead is not None and [id(r) for r in rows] == [id(ahead.row)] and 1 <= max_drafts[0] <= ahead.drafts.shape[0] \
                and len(rows[0].tokens) == ahead.length + int(ahead.accepted.item()) + 1:
            # drawn when the round before queued them (``ahead_drafts``); sliced only where fewer are wanted
            out = [Proposal(ahead.drafts if max_drafts[0] == ahead.drafts.shape[0] else ahead.drafts[: max_drafts[0]])]
        else:
            mx.async_eval([p.tokens for p in real if isinstance(p.tokens, mx.array)],
                          [p.logprobs for p in real if p.logprobs is not None])
            # row.tokens ends with the pending token at position len - 1: drafts start at len.
            out = [Proposal(self.oracle.drafts_for(r, m)) if m else Proposal([]) for r, m in zip(rows, max_drafts)]
        self.drafted.extend(len(p.tokens) for p in out if len(p.tokens))
        return out

    def draft_ahead(self, rows: Sequence[Any], unread: Unread, max_drafts: Sequence[int]) -> None:
        self.ahead = None
        self.inner.draft_ahead(rows, unread, max_drafts)  # from the oracle's outcome, as the round's is

    def ahead_drafts(self, rows: Sequence[Any], unread: Unread) -> Optional[List[mx.array]]:
        """The oracle's next drafts on the device (its draws taken now; ``propose`` serves them), where the
        inner drafter drafted ahead: the verify queued over them costs what the real drafts' would."""
        inner = self.inner.ahead_drafts(rows, unread)
        if self.oracle is None or not inner or inner[0] is None or len(rows) != 1:
            return inner
        a = unread.accepted[0]
        drafts = self.oracle.drafts_at(rows[0], a + 1, inner[0].shape[0])  # [k]
        self.ahead = AheadDrafts(rows[0], len(rows[0].tokens), a, drafts)
        return [drafts]

    def commit(self, rows: Sequence[Any], verified: Sequence[Verified]) -> List[int]:
        # The inner drafter proposed its own tokens: it keeps no more of them than the round kept.
        adjusted = [Verified(min(v.accepted, k), k, v.captures, v.source) for v, k in zip(verified, self.inner_k)]
        return self.inner.commit(rows, adjusted)


class WrappedDrafter(Drafter):
    """Any drafter, its batches wrapped (``OracleBatch``)."""

    def __init__(self, inner: Drafter, oracle: Optional[Oracle] = None):
        self.inner = inner
        self.oracle = oracle
        self.kind = inner.kind
        self.family = inner.family
        self.default_block_size = inner.default_block_size
        self.drafted: List[int] = []

    def capture_layers(self) -> List[int]:
        return self.inner.capture_layers()

    def new_batch(self) -> DraftBatch:
        return OracleBatch(self.inner.new_batch(), self.drafted, self.oracle)


class OracleDraftLM:
    """A draft LM for mlx-lm's ``speculative_generate_step`` whose forward runs for real but whose
    next-token logits point at the oracle's token (right with probability alpha per call)."""

    def __init__(self, model: Any, oracle: Oracle, vocab_size: int):
        self.model = model
        self.oracle = oracle
        self.vocab_size = vocab_size
        self.vocab = mx.arange(vocab_size)
        self.layers = getattr(model, "layers", None)
        self.sequence = mx.zeros((1,), dtype=mx.int32)

    def set_request(self) -> None:
        """Call after ``oracle.set_request``: the reference sequence on the device."""
        self.sequence = mx.array(self.oracle.sequence + [0] * 64, dtype=mx.int32)

    def make_cache(self) -> List[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        logits = self.model(inputs, cache=cache)  # [1, n, V]: the real cost (mlx-lm's loop calls us)
        position = cache[0].offset  # absolute position of the token this call predicts
        ref = self.sequence[position]
        # The round's chain is intact when the fed token is the reference one (the target's bonus
        # at a round's start, a right draft after it); stays lazy: no sync in mlx-lm's draft loop.
        intact = inputs[0, -1].astype(mx.int32) == self.sequence[position - 1]
        right = mx.logical_and(intact, mx.array(self.oracle.draw()))
        token = mx.where(right, ref, (ref + 1) % self.vocab_size)
        hot = (self.vocab == token).astype(logits.dtype) * 100.0  # [V]
        # keep a dependency on the real logits so that the forward is evaluated
        return hot[None, None, :] + 0 * logits[:, -1:, :1]  # [1, 1, V]
