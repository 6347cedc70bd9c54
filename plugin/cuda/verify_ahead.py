"""Verifying ahead: the next round's verify forward built before the host reads this round's outcome.

Why: with the next block drafted ahead (``DraftBatch.draft_ahead``), a round still spends host time between
reading its outcome and handing the device its next verify: committing, the host's step, taking up the block
and building the verify forward's graph (~1.5 ms of the ~3 ms, H200, Llama-3-8B shape, the round's own laps:
bench/results/attention/*-laps.json), while the device has only that block (~3 ms) to run; the verify's
encoding (``mx.async_eval``, ~5 ms) then paces its first kernels.

How: where the drafter drafted ahead (``DraftBatch.ahead_drafts``: the next round's draft tokens, still on
the device), ``queue`` builds the next verify's inputs [bonus, drafts, filler] on the device, as
``verify.inputs`` builds them from the host's, and the target's compiled forward over them at the device
offset base + a + 1 (``CompiledForward.forward_ahead``; base: the caches' offset before this round's verify),
without running it: the caches keep their buffers, and the forward's buffers (its W positions written past
every position this round keeps) wait in ``Queued``. The next round ``adopt``s it only where everything is as
assumed: the same single row, no step in between (its generated count), the caches holding the buffers it was
built on at offset base + a + 1 with the a the host read, the row's pending token the bonus it assumed, and
the round's drafts the array it verifies (the drafter's own, no read; anything else compared as ints). The
caches then take its buffers and the round runs it as its verify. Anything else verifies as usual, and the
forward built ahead is dropped without running: it costs host time, never device time or a token.

It is built, not run, because running it at once paid less than nothing: MLX lets the host queue at most
MAX_ACTIVE_TASKS = 10 tasks ahead of the device (``eval_impl``, mlx/transforms.cpp) and MLX-CUDA commits a task
every 100 ops or 1000 MB of arrays on an H100-class GPU (mlx/backend/cuda/device.cpp), so an 8B-shape forward
(16 GB of weights) is 16 tasks or more and queueing it blocked the host ~7-8 ms a round; on the H200 rounds ran
~0.5-2.5 ms longer than drafting ahead alone (bench/results/attention/*-vahead*.json, the round's laps in
profiles/h200-verify-ahead-probe*.json; larger tasks, ``MLX_MAX_MB_PER_BUFFER=20000
MLX_MAX_OPS_PER_BUFFER=500``, made it worse). Off by default (``MLX_SPEC_DRAFT_AHEAD=verify`` turns it on).

Exactness: an adopted forward is the target's ordinary forward over the same tokens at the same positions
on the same cache contents as the fresh one would be. It may be wider than the round's drafts need (fewer
drafts wanted than were built): causal attention keeps later positions out of earlier ones, and the
transaction trims them like rejected drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import mlx.core as mx

from ...drafters.base import DraftBatch, Proposal, Unread
from ...hooks.api import DecodeBatch
from ..verify import row_inputs


Buffers = Tuple[mx.array, mx.array]  # a cache's (keys, values) [B, H, S, D]


@runtime_checkable
class ForwardAhead(Protocol):
    """A backend forward that can be built ahead (compiled.py's ``CompiledForward``)."""

    def forward_ahead(self, model: Any, inputs: mx.array, cache: Sequence[Any], layers: Sequence[int], base: int,
                      shift: mx.array) -> Optional[Tuple[mx.array, Dict[int, mx.array], List[Buffers]]]:
        """The forward over ``inputs`` [1, W] at the device offset base + shift, the caches left as they are:
        (logits [1, W, V], {layer: [1, W, H]}, each cache's (keys, values) with the W positions written), or None."""


@dataclass
class Queued:
    """The next round's verify forward, built by this round (``queue``) and not yet run."""

    row: Any
    base: int  # the target caches' offset before this round's verify
    accepted: mx.array  # []: this round's a, as the forward assumed it
    bonus: mx.array  # []: this round's bonus, the forward's first input
    drafts: mx.array  # [k]: the drafter's drafts ahead it verifies
    inputs: mx.array  # [1, W]: [bonus, k drafts, filler]
    logits: mx.array  # [1, W, V]
    captured: Dict[int, mx.array]  # {layer: [1, W, H]}
    before: List[Tuple[mx.array, mx.array]]  # each target cache's (keys, values) it was built on
    after: List[Tuple[mx.array, mx.array]]  # the same with its W positions written
    offset: int = -1  # base + a + 1 once the host has read a (``settle``)
    generated: int = -1  # the row's generated count after this round's tokens (``settle``)


def queue(batch: DecodeBatch, drafter: DraftBatch, unread: Tuple[mx.array, mx.array], written: int,
          vocab_size: int, width_for: Callable[[int], int]) -> Optional[Queued]:
    """The next verify of the batch's one greedy row built from this round's unread (a, bonus), where the
    drafter drafted its next block ahead and the target's forward is compiled; else None. ``written``: the
    positions this round's verify fed (the caches' offset before it is theirs now less these)."""
    fwd = batch.target.cache_policy.forward
    rows = list(batch.rows)
    offset = getattr(batch.cache[0], "offset", None) if batch.cache else None  # a cache without one: not taken
    if len(rows) != 1 or not isinstance(fwd, ForwardAhead) or not isinstance(offset, int):
        return None
    a, bonus = unread
    drafts = drafter.ahead_drafts(rows, Unread(a.reshape(1), bonus.reshape(1), {}))
    if not drafts or drafts[0] is None or drafts[0].ndim != 1 or not drafts[0].shape[0]:
        return None
    inputs = row_inputs(bonus.reshape(1), drafts[0], width_for(1 + drafts[0].shape[0]), vocab_size)[None]  # [1, W]
    base = offset - written
    before = [(c.keys, c.values) for c in batch.cache]
    got = fwd.forward_ahead(batch.target.model, inputs, batch.cache, batch.capture_layers, base, a + 1)
    if got is None:
        return None
    logits, captured, after = got
    # Not evaluated here: MLX lets the host queue ~10 tasks ahead of the device and a forward is more (see above).
    return Queued(rows[0], base, a, bonus, drafts[0], inputs, logits, captured, before, after)


def settle(q: Optional[Queued], generated: int) -> Optional[Queued]:
    """After this round's commit: the offset and generated count the next round must find (reads of values the
    round has read already)."""
    if q is None:
        return None
    q.offset = q.base + int(q.accepted.item()) + 1
    q.generated = generated
    return q


def adopt(q: Optional[Queued], batch: DecodeBatch, proposals: Sequence[Proposal],
          vocab_size: int) -> Optional[Tuple[mx.array, Dict[int, mx.array], mx.array]]:
    """This round's verify (logits [1, W, V], captured, inputs [1, W]) where ``q`` is exactly it, the caches
    then taking its buffers and W positions (call inside the round's open target transaction); else None."""
    rows = list(batch.rows)
    if q is None or q.offset < 0 or len(rows) != 1 or rows[0] is not q.row or rows[0].generated != q.generated:
        return None
    cache = batch.cache
    if len(cache) != len(q.before) or any(c.keys is not k or c.values is not v or c.offset != q.offset
                                          for c, (k, v) in zip(cache, q.before)):
        return None
    if int(q.bonus.item()) != rows[0].pending:  # evaluated with the outcome of the round that built it
        return None
    drafts = proposals[0].tokens
    if drafts is not q.drafts:  # the drafter's own array needs no read; anything else is compared as ints
        # (a read that waits for the drafts, not for the queued forward: it is not queued yet)
        drafts = drafts.tolist() if isinstance(drafts, mx.array) else list(drafts)
        if not 1 <= len(drafts) <= q.drafts.shape[0]:
            return None
        top = vocab_size - 1 if vocab_size else None
        want = [min(int(t), top) if top is not None else int(t) for t in drafts]
        if q.inputs[0, 1 : 1 + len(want)].tolist() != want:
            return None
    W = q.inputs.shape[1]
    for c, (k, v) in zip(cache, q.after):
        c.keys, c.values = k, v
        c.offset += W
    return q.logits, q.captured, q.inputs
