"""Acceptance: which draft tokens a round keeps, and the bonus token. Pure functions.

Notation of Leviathan et al. 2023 / Chen et al. 2023: p is the target's distribution at a
position (after temperature, top-k/top-p/min-p and logits processors, as one-token decoding
applies them), q the drafter's; x_1..x_k the draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafters.base import Proposal


@dataclass
class RoundOutcome:
    """What verification decided for one row of a round."""

    draft_tokens: int  # k, proposals verified
    accepted: int  # a, leading draft tokens kept (0 <= a <= k)
    tokens: List[int] = field(default_factory=list)  # the a accepted tokens plus the bonus

    @property
    def emitted(self) -> int:
        return self.accepted + 1


def accept_prefix(drafts: Sequence[int], target: Sequence[int]) -> Tuple[int, int]:
    """Keep drafts while x_i == y_i (y: the target's tokens, [k+1]); the bonus is y after them."""
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return a, int(target[a])


def residual(p: mx.array, q: mx.array) -> mx.array:
    """p'(x) = norm(max(0, p(x) - q(x))), the distribution to sample after a rejection. [..., V].

    Where p <= q everywhere (p = q up to rounding) a rejection has probability ~0; p is returned.
    """
    r = mx.maximum(p - q, 0.0)  # [..., V]
    mass = r.sum(axis=-1, keepdims=True)  # [..., 1]
    return mx.where(mass > 0, r / mx.maximum(mass, 1e-30), p)


def rejection_accept(
    drafts: mx.array,
    draft_logprobs: Optional[mx.array],
    target_logprobs: mx.array,
    key: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1): every emitted token is distributed as p.

    drafts x_1..x_k: [..., k], x_i drawn from q_i. draft_logprobs log q: [..., k, V], or None for
    a drafter without a distribution (one-hot q_i at x_i). target_logprobs log p: [..., k+1, V],
    row i the target's distribution after x_1..x_i. p and q are after the same processing
    (``SamplingParams.process``). key: the target's stream (None: mlx's global random state).
    Returns (accepted a: [...], bonus token: [...]); ``...`` is any batch shape.
    """
    k, V = drafts.shape[-1], target_logprobs.shape[-1]
    if target_logprobs.shape[-2] != k + 1 or (draft_logprobs is not None and draft_logprobs.shape[-2:] != (k, V)):
        raise ValueError(
            f"rejection_accept: expected log p [..., {k + 1}, V] and log q [..., {k}, V] for {k} drafts; "
            f"got log p {tuple(target_logprobs.shape)} and log q "
            f"{None if draft_logprobs is None else tuple(draft_logprobs.shape)}"
        )
    key_r, key_bonus = (None, None) if key is None else mx.random.split(key)
    x = drafts.astype(mx.int32)[..., None]  # [..., k, 1]
    p = mx.exp(target_logprobs.astype(mx.float32))  # [..., k+1, V]
    if draft_logprobs is None:
        q = (mx.arange(V) == x).astype(mx.float32)  # [..., k, V]
    else:
        q = mx.exp(draft_logprobs.astype(mx.float32))  # [..., k, V]
    p_x = mx.take_along_axis(p[..., :k, :], x, axis=-1)[..., 0]  # [..., k]
    q_x = mx.take_along_axis(q, x, axis=-1)[..., 0]  # [..., k]

    # Keep x_i with probability min(1, p(x_i) / q(x_i)): r_i ~ U[0, 1), keep iff r_i q(x_i) < p(x_i)
    # (certain when p = q, never when p(x_i) = 0). The block stops at the first rejection.
    r = mx.random.uniform(shape=p_x.shape, key=key_r)  # [..., k]
    kept = (r * q_x < p_x).astype(mx.int32)
    a = mx.cumprod(kept, axis=-1).sum(axis=-1) if k else mx.zeros(drafts.shape[:-1], mx.int32)  # [...]

    # Bonus at position a+1: from norm(max(0, p - q)) after a rejection; from p after a full
    # block (q_{k+1} = 0 makes the residual p itself).
    q = mx.concatenate([q, mx.zeros_like(p[..., :1, :])], axis=-2)  # [..., k+1, V]
    row = a[..., None, None]
    p_a = mx.take_along_axis(p, row, axis=-2)[..., 0, :]  # [..., V]
    q_a = mx.take_along_axis(q, row, axis=-2)[..., 0, :]  # [..., V]
    bonus = mx.random.categorical(mx.log(residual(p_a, q_a)), key=key_bonus)  # [...]
    return a, bonus


def row_logprobs(row: Any, logits: mx.array, drafts: Sequence[int]) -> mx.array:
    """Row's processed log-probabilities after each of its verified positions: [k+1, V].

    Position i is the distribution of the token after ``drafts[:i]`` (0: after the pending token),
    with the logits processors applied as one-token decoding would (they need the drafts as ints).
    ``logits``: [1, W, V] of this row."""
    n = 1 + len(drafts)
    if row.logits_processors:
        return row.logprobs(logits[:, :n], list(drafts))
    rows = logits[0, :n]  # [k+1, V]
    return rows - mx.logsumexp(rows, axis=-1, keepdims=True)


Plan = Tuple[str, Any]  # ("step" | "walk" | "rejection", its unevaluated arrays)


def plan_rows(rows: Sequence[Any], proposals: Sequence[Proposal], drafts: Sequence[mx.array],
              logprobs: Sequence[mx.array], acceptance: str) -> List[Plan]:
    """Each row's acceptance by its own rule, still unevaluated (``read_plans`` reads them together).

    drafts[b]: row b's draft tokens x as fed to the verify, [k_b] (k_b = 0: it drafted nothing), with
    their log q in proposals[b]; logprobs[b]: its processed log p [k_b+1, V]. Temperature 0: the greedy
    walk. A seeded row (coupled sampling): the walk over its sampler's draws, each position's with that
    position's noise, so it emits exactly the tokens its one-token steps would (the drafts drew with the same
    noise, ``DecodeState.draw_drafts``). Else ``rejection`` (speculative sampling) or ``exact`` (mlx-lm's token
    match). A row that drafted nothing takes its one-token step here: its own sampler on position 0.
    """
    plans: List[Plan] = []
    for row, p, x, lp in zip(rows, proposals, drafts, logprobs):
        if not x.shape[0]:
            plans.append(("step", (mx.argmax(lp[:1], axis=-1) if row.sampling.greedy else row.sample(lp[:1]))))
        elif row.sampling.greedy:
            plans.append(("walk", mx.argmax(lp, axis=-1)))  # y: [k+1]
        elif acceptance == "rejection" and not row.coupled:
            # p: the target's rows after the sampler's processing; q comes processed from the drafter.
            plans.append(("rejection", rejection_accept(x, p.logprobs, row.sampling.process(lp))))
        else:
            plans.append(("walk", row.sample(lp)))  # y_i ~ p_i at every position (seeded: coupled)
    return plans


def accepted_prefix(drafts: mx.array, target: mx.array) -> Tuple[mx.array, mx.array]:
    """``accept_prefix`` on the device: drafts x [k], the target's tokens y [k+1] -> (a [], bonus y_a [])."""
    k = drafts.shape[0]
    same = (drafts.astype(mx.int32) == target[:k].astype(mx.int32)).astype(mx.int32)  # [k]
    a = mx.cumprod(same).sum()  # []: leading matches
    return a, mx.take(target, a)


def unread_outcome(plan: Plan, drafts: mx.array) -> Tuple[mx.array, mx.array]:
    """(accepted a [], bonus []) of a row's plan before the host reads it (drafting ahead starts from
    them); a row that drafted nothing: (0, its one token)."""
    how, x = plan
    if how == "step":
        return mx.zeros((), mx.int32), x.reshape(-1)[0]
    return x if how == "rejection" else accepted_prefix(drafts, x)


def walked(drafts: Sequence[int], target: Sequence[int]) -> RoundOutcome:
    """The greedy walk's outcome for drafts x [k] against the target's tokens y [k+1] (ints)."""
    a, bonus = accept_prefix(drafts, target)
    return RoundOutcome(len(drafts), a, list(drafts[:a]) + [bonus])


def read_plans(plans: Sequence[Plan], proposals: Sequence[Proposal]) -> List[RoundOutcome]:
    """The plans evaluated together (one synchronisation for the batch) into outcomes; ``proposals``
    hold ints by now."""
    mx.eval([x for _, x in plans])
    out = []
    for (how, x), p in zip(plans, proposals):
        drafts = list(p.tokens)
        if how == "step":
            out.append(RoundOutcome(0, 0, [int(x.item())]))
        elif how == "walk":
            out.append(walked(drafts, x.tolist()))
        else:
            a, bonus = int(x[0].item()), int(x[1].item())
            out.append(RoundOutcome(len(drafts), a, drafts[:a] + [bonus]))
    return out


def greedy_batch(logits: mx.array, fed: mx.array, counts: Sequence[int]) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """Every row's greedy walk at once (rows without logits processors): the log p [B, W, V], the target's
    tokens y [B, W], accepted a [B] and bonus y_a [B]. ``fed``: the verify's inputs [B, W], row b's drafts at
    1..counts[b]. The same per-row arithmetic as ``row_logprobs`` and ``accepted_prefix``, in a few
    batch-wide ops instead of ~10 a row (an 8-row round built ~100 small graphs per step)."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # [B, W, V]
    y = mx.argmax(logp, axis=-1)  # [B, W]
    W = fed.shape[1]
    within = mx.arange(W - 1)[None] < mx.array(list(counts))[:, None]  # [B, W-1]: a row's own drafts
    same = (fed[:, 1:].astype(mx.int32) == y[:, :-1].astype(mx.int32)) & within  # [B, W-1]
    a = mx.cumprod(same.astype(mx.int32), axis=-1).sum(axis=-1)  # [B]: leading matches
    return logp, y, a, mx.take_along_axis(y, a[:, None], axis=-1)[:, 0]


class RoundPlans:
    """Every row's acceptance for a round, still on the device (``arrays``); ``read`` evaluates them together.

    Rows all greedy without logits processors: one batch-wide walk (``greedy_batch``). Otherwise each row by its
    own rule (``plan_rows``). ``fed``: the verify's inputs [B, W]; ``logits``: its [B, W, V]."""

    def __init__(self, rows: Sequence[Any], proposals: Sequence[Proposal], logits: mx.array, fed: mx.array,
                 acceptance: str) -> None:
        self.counts = [len(p.tokens) for p in proposals]
        self.batch: Optional[Tuple[mx.array, mx.array, mx.array, mx.array]] = None
        self.plans: List[Plan] = []
        self.drafts: List[mx.array] = []
        self.logprobs: List[mx.array] = []
        if all(r.sampling.greedy and not r.logits_processors for r in rows):
            self.batch = greedy_batch(logits, fed, self.counts)
        else:
            self.drafts = [fed[b, 1 : 1 + k] for b, k in enumerate(self.counts)]  # [k_b] as fed
            self.logprobs = [row_logprobs(row, logits[b : b + 1], p.tokens) for b, (row, p) in enumerate(zip(rows, proposals))]
            self.plans = plan_rows(rows, proposals, self.drafts, self.logprobs, acceptance)

    @property
    def arrays(self) -> List[mx.array]:
        return [self.batch[1]] if self.batch is not None else [x for _, x in self.plans]

    def logprob(self, b: int, i: int) -> mx.array:
        """Row b's processed log p after its i-th verified position: [V]."""
        return self.batch[0][b, i] if self.batch is not None else self.logprobs[b][i]

    def unread(self) -> Tuple[mx.array, mx.array]:
        """The rows' (accepted a [B] int32, bonus [B] uint32) before the host reads them (drafting ahead starts from
        them); a row that drafted nothing: (0, its one token)."""
        if self.batch is not None:
            _, _, a, bonus = self.batch
        else:
            each = [unread_outcome(plan, x) for plan, x in zip(self.plans, self.drafts)]
            a, bonus = mx.stack([u[0].reshape(()) for u in each]), mx.stack([u[1].reshape(()) for u in each])
        return a.astype(mx.int32), bonus.astype(mx.uint32)

    def read(self, proposals: Sequence[Proposal]) -> List[RoundOutcome]:
        """The outcomes (one synchronisation for the batch); ``proposals`` hold ints by now."""
        if self.batch is None:
            return read_plans(self.plans, proposals)
        y = self.batch[1].tolist()  # [B][W]
        return [walked(list(p.tokens), ys[: len(p.tokens) + 1]) for ys, p in zip(y, proposals)]
