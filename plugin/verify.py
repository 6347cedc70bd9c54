"""Verifying a round: ONE ordinary forward of the target over [pending, *drafts]."""

from __future__ import annotations

from typing import Any, Sequence, Union

import mlx.core as mx

from .padded_cache import verify_width


def verify(state: Any, drafts: Union[Sequence[int], mx.array], vocab_size: int = 0) -> mx.array:
    """The target's processed log-probabilities after each verified position: [k+1, V].

    Row i is the distribution of the token after ``drafts[:i]`` (row 0: after the pending token),
    with the logits processors applied per row as one-token decoding would. The forward runs on
    the target's own caches; the caller wraps it in a cache transaction. ``drafts`` may be a lazy
    [k] array (no logits processors then): the forward is queued behind the drafter's kernels,
    clipped to the vocabulary so that a faulty drafter cannot read outside the embedding (the
    round checks the drafts afterwards and rolls back).
    """
    n = 1 + len(drafts)
    # Shape-stable caches want a few query widths only: pad with filler positions after the real
    # ones (causal attention keeps them out of the real rows; the transaction trims them).
    width = verify_width(state.cache, n)
    if isinstance(drafts, mx.array):
        if state.logits_processors:
            raise ValueError("verify: lazy draft arrays cannot be scored with logits processors; pass ints")
        body = drafts.astype(mx.uint32)
        if vocab_size:
            body = mx.minimum(body, vocab_size - 1)
        fed = mx.concatenate([mx.array([state.pending], dtype=mx.uint32), body,
                              mx.full((width - n,), state.pending, dtype=mx.uint32)])  # [width]
        logits = state.forward(fed)[:, :n]  # [1, k+1, V]
        logprobs = state.logprobs(logits)
    else:
        logits = state.forward([state.pending, *drafts] + [state.pending] * (width - n))[:, :n]  # [1, k+1, V]
        logprobs = state.logprobs(logits, drafts)  # [k+1, V]
    mx.eval(logprobs)
    return logprobs
