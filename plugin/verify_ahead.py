"""Verifying ahead: the next round's verify forward queued before the host reads this round's outcome.

Why: with the next block drafted ahead (``DraftBatch.draft_ahead``), a round still spent ~2.5-3 ms on the
host after reading its outcome (commit, emit, the host's step, building the next verify) while the device
had only that block (~1.5-2 ms) to run (H200, 16k keys: bench/results/profiles/h200-round-trace-ahead.json).
With the next verify queued as well, the device holds a whole round while the host does the last one's
bookkeeping, as mlx-lm's ``generate_step`` queues its next token before yielding this one.

How: where the drafter drafted ahead (``DraftBatch.ahead_drafts``: the next round's draft tokens, still on
the device), ``queue`` builds the next verify's inputs [bonus, drafts, filler] on the device, as
``verify.inputs`` builds them from the host's, and runs the target's compiled forward at the device offset
base + a + 1 (``CompiledForward.forward_at``; base: the caches' offset before this round's verify). Its
writes land past every position this round keeps, so the target caches take its buffers at once (the
positions they keep are the same in both; the rest lie past their offset, unread, as after a trim) and
their offset stays. The next round ``adopt``s it only where everything is as assumed: the same single row,
no step in between (its generated count), the caches' buffers the ones it wrote and their offset
base + a + 1 with the a the host read, the row's pending token its first input and the round's drafts its
next ones (compared on the device, read as one bool). Anything else verifies as usual: a queued forward
can cost device time, never a token.

Measured slower, so off by default (``MLX_SPEC_DRAFT_AHEAD=verify`` turns it on): on the H200 (Llama-3-8B
shape, DFlash at oracle tau 6.5, prompts near 512-16,384; bench/results/attention/*-vahead*.json) a round took
~2-2.5 ms more than drafting ahead alone (the bench's verify per round 13.6 / 15.9 ms warm against 11.4 / 13.1,
two runs). Timed inside the round (bench/verify_ahead_probe.py, bench/results/profiles/h200-verify-ahead-probe*.json)
``queue`` blocks ~7 ms and ``adopt`` ~3.5 ms, while reading the outcome no longer waits: the host does not get a
whole forward ahead of the device. (``adopt`` then read a slice of the inputs, a new op queued behind the forward;
it reads the evaluated inputs now, not measured since.) MLX's source says why: ``eval_impl`` (mlx/transforms.cpp) waits for a task to
finish whenever more than MAX_ACTIVE_TASKS = 10 are in flight, and MLX-CUDA commits a task every 100 ops or
1000 MB of arrays on an H100-class GPU (mlx/backend/cuda/device.cpp), so an 8B-shape forward (16 GB of weights)
is 16 tasks or more. MLX_MAX_OPS_PER_BUFFER=400 (the MB bound still applies) and 4000 with
MLX_MAX_MB_PER_BUFFER=100000 did not lift it in one probe each. A copy of the K/V buffers (MLX does not write in
place a buffer that queued work still reads: seen on the CPU) costs nothing measurable on the H200
(bench/queued_write_cost.py, bench/results/kernels/h200-queued-write.txt).

Exactness: an adopted forward is the target's ordinary forward over the same tokens at the same positions
on the same cache contents as the fresh one would be. It may be wider than the round's drafts need (fewer
drafts wanted than were queued): causal attention keeps later positions out of earlier ones, and the
transaction trims them like rejected drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..drafters.base import DraftBatch, Proposal, Unread
from ..hooks.batch import DecodeBatch
from .verify import row_inputs


@dataclass
class Queued:
    """The next round's verify forward, queued by this round (``queue``)."""

    row: Any
    base: int  # the target caches' offset before this round's verify
    accepted: mx.array  # []: this round's a, as the forward assumed it
    inputs: mx.array  # [1, W]: [bonus, k drafts, filler]
    logits: mx.array  # [1, W, V]
    captured: Dict[int, mx.array]  # {layer: [1, W, H]}
    keys: List[Any]  # each target cache's keys buffer after queueing (the ones holding its writes)
    offset: int = -1  # base + a + 1 once the host has read a (``settle``)
    generated: int = -1  # the row's generated count after this round's tokens (``settle``)

    @property
    def drafts(self) -> int:
        """Positions after the first (drafts and filler): ``adopt`` compares every token the round proposes."""
        return self.inputs.shape[1] - 1


def queue(batch: DecodeBatch, drafter: DraftBatch, unread: Optional[Tuple[mx.array, mx.array]], written: int,
          vocab_size: int, width_for: Callable[[int], int]) -> Optional[Queued]:
    """The next verify of the batch's one greedy row queued from this round's unread (a, bonus), where the
    drafter drafted its next block ahead and the target's forward is compiled; else None. ``written``: the
    positions this round's verify fed (the caches' offset before it is theirs now less these)."""
    fwd = getattr(batch.target.cache_policy, "forward", None)
    rows = list(batch.rows)
    offset = getattr(batch.cache[0], "offset", None) if batch.cache else None
    if unread is None or len(rows) != 1 or not hasattr(fwd, "forward_at") or not isinstance(offset, int):
        return None
    a, bonus = unread
    drafts = drafter.ahead_drafts(rows, [Unread(a, bonus, {})])
    if not drafts or drafts[0] is None or drafts[0].ndim != 1 or not drafts[0].shape[0]:
        return None
    inputs = row_inputs(bonus.reshape(1), drafts[0], width_for(1 + drafts[0].shape[0]), vocab_size)[None]  # [1, W]
    # Queued on their own, ahead of the forward: ``adopt`` reads them without waiting for it (the device runs
    # queued work in order, so reading an array evaluated only inside the forward's graph would wait for all of it).
    mx.async_eval(inputs, drafts[0])
    base = offset - written
    got = fwd.forward_at(batch.target.model, inputs, batch.cache, batch.capture_layers, base, a + 1)
    if got is None:
        return None
    logits, captured = got
    mx.async_eval(logits, list(captured.values()), [c.keys for c in batch.cache], [c.values for c in batch.cache])
    return Queued(rows[0], base, a, inputs, logits, captured, [c.keys for c in batch.cache])


def settle(q: Optional[Queued], generated: int) -> Optional[Queued]:
    """After this round's commit: the offset and generated count the next round must find (a read now)."""
    if q is None:
        return None
    q.offset = q.base + int(q.accepted.item()) + 1
    q.generated = generated
    return q


def adopt(q: Optional[Queued], batch: DecodeBatch, proposals: Sequence[Proposal],
          vocab_size: int) -> Optional[Tuple[mx.array, Dict[int, mx.array], mx.array]]:
    """This round's verify (logits [1, W, V], captured, inputs [1, W]) where ``q`` is exactly it, the caches
    then taking its W positions (call inside the round's open target transaction); else None."""
    rows = list(batch.rows)
    if q is None or q.offset < 0 or len(rows) != 1 or rows[0] is not q.row or rows[0].generated != q.generated:
        return None
    cache = batch.cache
    if len(cache) != len(q.keys) or any(c.keys is not k or c.offset != q.offset for c, k in zip(cache, q.keys)):
        return None
    drafts = proposals[0].tokens
    # Read on the host from arrays already evaluated (the drafter's and ``queue``'s): a new op would wait for the
    # queued forward itself.
    drafts = drafts.tolist() if isinstance(drafts, mx.array) else list(drafts)
    if not 1 <= len(drafts) <= q.drafts:
        return None
    top = vocab_size - 1 if vocab_size else None
    want = [rows[0].pending] + [min(int(t), top) if top is not None else int(t) for t in drafts]
    if q.inputs.tolist()[0][: len(want)] != want:  # not q.inputs[0]: a slice is a new op
        return None
    W = q.inputs.shape[1]
    for c in cache:
        c.offset += W
    return q.logits, q.captured, q.inputs
